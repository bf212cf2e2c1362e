// The disk tier of the node's host-memory budget: when a pause needs more host memory than
// the budget could give even with the host caches given back, the largest backed-up
// allocations go to disk files for that pause instead (the saver marks them; the disk tier
// writes and reads them, as for regions with disk backup), and come back to host copies once
// resumed.
#include <algorithm>
#include <set>

#include "tiers/backup_tiers.h"

namespace tmsl {

std::vector<uintptr_t> BackupTiers::choose_spill(const std::vector<SpillCandidate>& selected, bool everything) {
  // The selection's copies: the arenas this pause takes copies from are not given back,
  // and a copy kept of the right size is reused (no new host memory). Only sizes and arenas
  // are read: no need to wait for a range being shared.
  std::vector<uintptr_t> vas;
  vas.reserve(selected.size());
  for (const SpillCandidate& c : selected) vas.push_back(c.va);
  const std::vector<HostBuffer> copies = copies_.peek(vas);
  std::set<const HostArena*> reused;
  std::vector<const SpillCandidate*> candidates;
  size_t need = 0;
  for (size_t i = 0; i < selected.size(); ++i) {
    const SpillCandidate& c = selected[i];
    if (copies[i]) reused.insert(copies[i].arena.get());
    const bool reusable = copies[i] && copies[i].size == c.backup_bytes;
    if (!c.wants_host || reusable) continue;
    candidates.push_back(&c);
    need += c.backup_bytes;
  }
  // What this process's cache would give back.
  const size_t cache_back = pool_.bytes() + copies_.cached_arena_bytes(reused);
  // The budget takes the node's lock.
  const size_t shortfall = need == 0 ? 0 : spill_shortfall(need, cache_back, everything);
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const SpillCandidate* x, const SpillCandidate* y) { return x->backup_bytes > y->backup_bytes; });
  std::vector<uintptr_t> marked;
  size_t freed = 0;  // host memory the marks spare
  for (const SpillCandidate* c : candidates) {
    if (freed >= shortfall) break;
    marked.push_back(c->va);
    freed += c->backup_bytes;
  }
  return marked;
}

}  // namespace tmsl
