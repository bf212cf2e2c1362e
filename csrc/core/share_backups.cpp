// The saver's side of backups stored once per node (node_store.h): after a pause, in the
// background, the large paused backups are offered to the node's store range by range; a
// range whose bytes another process holds too is then held once.
#include "node/node_store.h"
#include "core/saver.h"

namespace tmsl {

void Saver::share_paused_backups() {
  cache_wanted_.store(false);
  struct Offer {
    uintptr_t va;
    std::shared_ptr<HostArena> arena;
    std::vector<size_t> ranges;
  };
  std::vector<Offer> offers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (retain_backups_.load()) return;  // a retained copy is written again by the next pause
    for (auto& entry : table_) {
      const Allocation& a = entry.second;
      // Only backups that fill page-locked ranges of their own: those of large allocations.
      if (a.state != State::kPaused || !a.host_copy || a.host_copy.size <= HostArena::kRangeBytes) continue;
      offers.push_back(Offer{a.va, a.host_copy.arena, {}});
    }
  }
  for (Offer& offer : offers) {
    const HostBuffer* copy = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = table_.find(offer.va);
      if (it != table_.end() && it->second.host_copy.arena == offer.arena) copy = &it->second.host_copy;
      if (copy != nullptr) offer.ranges = offer.arena->ranges_within(copy->offset, copy->size);
    }
    for (size_t range : offer.ranges) {
      // Foreground work goes first: the pass ends as soon as an operation waits (a backup
      // about to be resumed gains nothing from being shared) or another process wants this
      // one's cache.
      // Replacing pages unpins and pins them again: after the foreground's allocations too.
      tiers_.gate().wait_quiet([this] { return closing_.load() || foreground_waiting_.load() > 0; });
      if (closing_.load() || foreground_waiting_.load() > 0 || cache_wanted_.exchange(false)) return;
      // One range at a time under the operation lock: nothing reads or writes the backup
      // while its pages are replaced.
      std::lock_guard<std::mutex> op(op_mu_);
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = table_.find(offer.va);
        if (it == table_.end() || it->second.state != State::kPaused || it->second.host_copy.arena != offer.arena) break;
      }
      // Best effort: a range not shared stays private, and so do the rest of this pass (no
      // room to publish, a driver without read-only page-locking: the next ranges would fail alike).
      if (!offer.arena->share_range(range).ok()) return;
    }
  }
}

}  // namespace tmsl
