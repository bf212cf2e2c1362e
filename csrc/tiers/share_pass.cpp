// Backups stored once per node (node_store.h), the tiers' side: after a pause, in the
// background, the large paused copies are offered to the node's store range by range; a
// range whose bytes another process holds too is then held once. While a range's pages are
// replaced its copy is busy (HostCopies): nothing takes, leases or restores it meanwhile.
#include "tiers/backup_tiers.h"

namespace tmsl {

void BackupTiers::share_paused_copies(bool retain) {
  cache_wanted_.store(false);
  if (retain) return;  // a retained copy is written again by the next pause
  // Only copies that fill page-locked ranges of their own: those of large allocations.
  for (const auto& [va, arena] : copies_.paused_large(HostArena::kRangeBytes)) {
    for (size_t range : copies_.ranges_of(va, arena.get())) {
      // Foreground work goes first: the pass ends as soon as an operation is under way or
      // waits (a backup about to be resumed gains nothing from being shared) or another
      // process wants this one's cache.
      // Replacing pages unpins and pins them again: after the foreground's allocations too.
      gate_.wait_quiet([this] { return closing() || foreground_waiting_.load() > 0; });
      if (closing() || foreground_waiting_.load() > 0 || cache_wanted_.exchange(false)) return;
      // Resumed, freed or replaced meanwhile: its copy is no longer this one.
      if (!copies_.begin_share(va, arena.get())) break;
      // Best effort: a range not shared stays private, and so do the rest of this pass (no
      // room to publish, a driver without read-only page-locking: the next ranges would fail alike).
      // (status_of: an exception must not leave the copy busy, which a resume would wait for.)
      Status s = status_of([&] { return arena->share_range(range); });
      copies_.end_share(va, arena.get());
      if (!s.ok()) return;
    }
  }
}

}  // namespace tmsl
