// Background host work gives way to the foreground. Page-locking, unpinning and unmapping
// host memory take the driver's locks and stall the program's own cuMemCreate, cuMemMap and
// copies. The saver pushes an activity stamp around every allocation, free, pause and
// resume (Active); background work asks wait_quiet() before each such call, which returns
// once no foreground operation runs and none ended within kQuiet (an allocation loop leaves
// only gaps of microseconds between its calls), or at once when the work became urgent
// (a pause waits for that very memory), the foreground asked for everything deferred
// (Flush: a pause short of host memory needs what is waiting to be freed) or it is to stop.
// A foreground that never pauses for kQuiet holds the work off at most kLongest: memory let
// go is freed in the end.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace tmsl {

class ForegroundGate {
 public:
  static constexpr std::chrono::milliseconds kQuiet{20};
  static constexpr std::chrono::milliseconds kLongest{1000};

  // The foreground at work for its lifetime.
  class Active {
   public:
    explicit Active(ForegroundGate& gate) : gate_(gate) { gate_.enter(); }
    ~Active() { gate_.leave(); }
    Active(const Active&) = delete;
    Active& operator=(const Active&) = delete;

   private:
    ForegroundGate& gate_;
  };

  void enter() { active_.fetch_add(1); }
  void leave() {
    last_end_.store(now_ticks());
    if (active_.fetch_sub(1) == 1 && waiters_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      changed_.notify_all();
    }
  }
  // For its lifetime, background work waits for nothing (the foreground needs its result).
  class Flush {
   public:
    explicit Flush(ForegroundGate& gate) : gate_(gate) {
      gate_.flushing_.fetch_add(1);
      gate_.poke();
    }
    ~Flush() { gate_.flushing_.fetch_sub(1); }
    Flush(const Flush&) = delete;
    Flush& operator=(const Flush&) = delete;

   private:
    ForegroundGate& gate_;
  };
  // Wakes the waiters to look at their urgency again.
  void poke() {
    std::lock_guard<std::mutex> lock(mu_);
    changed_.notify_all();
  }
  // Returns once the foreground is quiet, or `urgent()` holds. Counts each wait that had to
  // wait (deferrals(): what the tests observe).
  template <typename Urgent>
  void wait_quiet(Urgent&& urgent) {
    auto go = [&] { return quiet() || flushing_.load() > 0 || urgent(); };
    if (go()) return;
    deferrals_.fetch_add(1);
    waiters_.fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + kLongest;
    std::unique_lock<std::mutex> lock(mu_);
    while (!go() && std::chrono::steady_clock::now() < until) changed_.wait_for(lock, std::chrono::milliseconds(2));
    waiters_.fetch_sub(1);
  }
  bool quiet() const {
    return active_.load() == 0 && now_ticks() - last_end_.load() >= static_cast<int64_t>(kQuiet.count()) * 1000000;
  }
  size_t deferrals() const { return deferrals_.load(); }
  size_t waiting() const { return waiters_.load(); }

 private:
  static int64_t now_ticks() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::atomic<int> active_{0};
  std::atomic<int64_t> last_end_{INT64_MIN / 2};
  std::atomic<int> waiters_{0};
  std::atomic<int> flushing_{0};  // Flush scopes open
  std::atomic<size_t> deferrals_{0};
  std::mutex mu_;
  std::condition_variable changed_;
};

}  // namespace tmsl
