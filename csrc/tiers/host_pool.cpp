#include "tiers/host_pool.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>

namespace tmsl {
namespace {

constexpr size_t kBufferAlignment = 4096;
size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

struct HostPool::State : std::enable_shared_from_this<HostPool::State> {
  std::mutex mu;
  std::vector<std::unique_ptr<HostArena>> arenas;  // least recently used first
  size_t bytes = 0;
  size_t limit = 0;
  size_t returns = 0;
  bool closed = false;  // the pool is gone: arenas let go are freed where they are
  int free_now = 0;     // FreeNow scopes open: what is let go is freed where it is let go
  BackgroundWork* background = nullptr;  // valid until closed
  ForegroundGate* gate = nullptr;

  // Arenas let go and not yet freed, oldest first, and how many a thread is freeing now.
  std::deque<std::unique_ptr<HostArena>> to_free;
  int freeing = 0;
  std::condition_variable freed;

  // Frees arenas off the caller's thread once the foreground is quiet: one background task
  // per arena, each taking the oldest one left, so that a foreground that needs the bytes at
  // once (free_pending_now) may take them all before the tasks run. Called without mu: where
  // no background thread runs, the tasks run here.
  void free_in_background(std::vector<std::unique_ptr<HostArena>> let_go) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) return;  // freed here
      for (auto& arena : let_go) to_free.push_back(std::move(arena));
    }
    std::shared_ptr<State> self = shared_from_this();
    for (size_t k = 0; k < let_go.size(); ++k) {
      background->run_after_foreground(*gate, [self](bool in_background) { self->free_one(in_background); });
    }
  }
  void free_one(bool in_background) {
    std::unique_ptr<HostArena> arena;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (to_free.empty()) return;  // freed by the foreground meanwhile
      arena = std::move(to_free.front());
      to_free.pop_front();
      ++freeing;
    }
    if (in_background) arena->give_back_gently();
    arena.reset();
    std::lock_guard<std::mutex> lock(mu);
    --freeing;
    freed.notify_all();
  }
  // Arenas over the limit, least recently used first. Needs mu.
  std::vector<std::unique_ptr<HostArena>> trim() {
    std::vector<std::unique_ptr<HostArena>> over;
    size_t k = 0;
    while (bytes > limit && k < arenas.size()) {
      bytes -= arenas[k]->used_bytes();
      over.push_back(std::move(arenas[k++]));
    }
    arenas.erase(arenas.begin(), arenas.begin() + static_cast<std::ptrdiff_t>(k));
    return over;
  }
  void come_back(HostArena* raw, bool poolable) {
    std::unique_ptr<HostArena> arena(raw);
    std::unique_lock<std::mutex> lock(mu);
    if (closed) {
      lock.unlock();
      return;  // freed here
    }
    ++returns;
    if (poolable && arena->poolable() && bytes + arena->used_bytes() <= limit) {
      bytes += arena->used_bytes();
      // By last use: the least recently used go first.
      auto at = std::upper_bound(arenas.begin(), arenas.end(), arena->last_use(),
                                 [](uint64_t use, const std::unique_ptr<HostArena>& a) { return use < a->last_use(); });
      arenas.insert(at, std::move(arena));
      return;
    }
    const bool here = free_now > 0;  // the caller needs the bytes back at once
    lock.unlock();
    if (here) return;  // freed here
    std::vector<std::unique_ptr<HostArena>> let_go;
    let_go.push_back(std::move(arena));
    free_in_background(std::move(let_go));
  }
};

HostPool::FreeNow::FreeNow(HostPool& pool) : pool_(pool) {
  std::lock_guard<std::mutex> lock(pool_.state_->mu);
  ++pool_.state_->free_now;
}

HostPool::FreeNow::~FreeNow() {
  std::lock_guard<std::mutex> lock(pool_.state_->mu);
  --pool_.state_->free_now;
}

HostPool::HostPool(BackgroundWork& background, ForegroundGate& gate) : state_(std::make_shared<State>()) {
  state_->background = &background;
  state_->gate = &gate;
}

HostPool::~HostPool() {
  std::vector<std::unique_ptr<HostArena>> let_go;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->closed = true;
    let_go = std::move(state_->arenas);
    for (auto& arena : state_->to_free) let_go.push_back(std::move(arena));  // their tasks find none
    state_->to_free.clear();
    state_->bytes = 0;
  }
}

std::shared_ptr<HostArena> HostPool::track(std::unique_ptr<HostArena> arena, bool poolable) {
  std::shared_ptr<State> state = state_;
  return std::shared_ptr<HostArena>(arena.release(), [state, poolable](HostArena* a) { state->come_back(a, poolable); });
}

void HostPool::take(int device, const std::vector<size_t>& sizes, std::vector<HostBuffer>* out) {
  std::vector<size_t> wanted;  // indices, largest first
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if ((*out)[i]) continue;
    wanted.push_back(i);
    total += round_up(sizes[i], kBufferAlignment);
  }
  if (wanted.empty()) return;
  std::stable_sort(wanted.begin(), wanted.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::vector<size_t> order;  // candidate arenas
    for (size_t k = 0; k < state_->arenas.size(); ++k) {
      if (state_->arenas[k]->device() == device) order.push_back(k);
    }
    if (order.empty()) return;
    auto size_of = [&](size_t k) { return state_->arenas[k]->used_bytes(); };
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return size_of(a) > size_of(b); });
    // The smallest that holds everything, if one does (it is last among those that do).
    size_t whole = order.size();
    for (size_t j = 0; j < order.size() && size_of(order[j]) >= total; ++j) whole = j;
    if (whole < order.size()) order = {order[whole]};
    std::vector<bool> used(state_->arenas.size(), false);
    std::vector<std::pair<size_t, size_t>> placed;  // (index, offset), per arena below
    for (size_t k : order) {
      placed.clear();
      // First fit, largest buffers first, into the runs of page-locked ranges.
      std::vector<std::pair<size_t, size_t>> spans = state_->arenas[k]->spans();
      for (size_t& i : wanted) {
        if (i == SIZE_MAX) continue;
        for (auto& span : spans) {
          if (span.second - span.first < sizes[i]) continue;
          placed.emplace_back(i, span.first);
          span.first = std::min(span.second, round_up(span.first + sizes[i], kBufferAlignment));
          i = SIZE_MAX;  // placed
          break;
        }
      }
      if (placed.empty()) continue;
      used[k] = true;
      HostArena* arena = state_->arenas[k].get();
      arena->note_use();
      arena->hurry();  // a pause copies into it now
      // Handed out under the same deleter: back here when its new holders let go.
      std::shared_ptr<State> state = state_;
      std::shared_ptr<HostArena> shared(state_->arenas[k].release(),
                                        [state](HostArena* a) { state->come_back(a, true); });
      state_->bytes -= shared->used_bytes();
      for (const auto& [i, offset] : placed) (*out)[i] = HostBuffer{shared, offset, sizes[i]};
    }
    std::vector<std::unique_ptr<HostArena>> kept;
    for (size_t k = 0; k < state_->arenas.size(); ++k) {
      if (!used[k]) kept.push_back(std::move(state_->arenas[k]));
    }
    state_->arenas = std::move(kept);
  }
}

size_t HostPool::bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->bytes;
}

size_t HostPool::bytes_on(int device) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  size_t bytes = 0;
  for (const auto& arena : state_->arenas) {
    if (arena->device() == device) bytes += arena->used_bytes();
  }
  return bytes;
}

void HostPool::free_pending_now() {
  std::unique_lock<std::mutex> lock(state_->mu);
  std::deque<std::unique_ptr<HostArena>> let_go = std::move(state_->to_free);
  state_->to_free.clear();
  lock.unlock();
  let_go.clear();  // here
  lock.lock();
  state_->freed.wait(lock, [&] { return state_->freeing == 0; });  // those a thread is freeing now
}

size_t HostPool::limit() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->limit;
}

size_t HostPool::returns() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->returns;
}

void HostPool::set_limit(size_t bytes, bool now) {
  std::vector<std::unique_ptr<HostArena>> over;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->limit = bytes;
    over = state_->trim();
  }
  if (now) {
    over.clear();  // here, off the lock
  } else {
    // In the background whatever another thread's FreeNow says: the caller may hold locks
    // that unpinning gigabytes must not be done under.
    state_->free_in_background(std::move(over));
  }
}

}  // namespace tmsl
