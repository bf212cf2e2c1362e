// The disk tier of the node's host-memory budget: when a pause needs more host memory than
// the budget could give even with the host caches given back, the saver's largest backed-up
// allocations go to disk files for that pause instead (written and read by the disk tier,
// as for regions with disk backup), and come back to host backups once resumed.
#include <algorithm>
#include <cstdio>
#include <set>

#include "core/saver.h"

namespace tmsl {

size_t Saver::choose_spill(const TagSelection& selection, bool everything) {
  // Under op_mu_: no other pause chooses host memory meanwhile, nor frees what this one
  // reuses. Backed-up resident allocations that would take new host memory at
  // this pause, and the arenas it takes copies from (not given back). Needs mu_.
  auto candidates_of = [&](std::vector<Allocation*>* candidates, std::set<const HostArena*>* reused) {
    size_t need = 0;
    for_each_selected(selection, [&](Allocation& a) {
      if (a.state == State::kActive) a.disk_marked = false;  // judged afresh
      if (a.host_copy) reused->insert(a.host_copy.arena.get());
      const bool reusable = a.host_copy && a.host_copy.size == a.backup_bytes();
      if (a.state != State::kActive || !a.backs_up() || reusable) return;
      candidates->push_back(&a);
      need += a.backup_bytes();
    });
    return need;
  };
  size_t need = 0, cache_back = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Allocation*> candidates;
    std::set<const HostArena*> reused;
    need = candidates_of(&candidates, &reused);
    cache_back = tiers_.pool().bytes();  // what this process's cache would give back
    for (const auto& entry : cached_arenas()) {
      if (reused.count(entry.first) == 0) cache_back += entry.first->used_bytes();
    }
  }
  // Off the table lock: the budget takes the node's lock.
  const size_t shortfall = need == 0 ? 0 : tiers_.spill_shortfall(need, cache_back, everything);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Allocation*> candidates;  // afresh: frees may have run meanwhile
  std::set<const HostArena*> reused;
  candidates_of(&candidates, &reused);
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Allocation* x, const Allocation* y) { return x->backup_bytes() > y->backup_bytes(); });
  size_t bytes = 0;
  size_t freed = 0;  // host memory the marks spare
  for (Allocation* a : candidates) {
    if (freed >= shortfall) break;
    a->disk_marked = true;
    freed += a->backup_bytes();
    bytes += a->size;
  }
  if (bytes > 0 && disk_) {
    char size[32];
    snprintf(size, sizeof(size), "%.0f MiB", bytes / 1048576.0);
    disk_->note(std::string("the node's host-memory budget cannot hold the backups of this pause: ") + size +
                " of them go to disk backup in " + disk_->directory() + " instead");
  }
  return bytes;
}

size_t Saver::spilled_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (const auto& entry : table_) {
    if (entry.second.disk_marked && entry.second.state == State::kPaused) bytes += entry.second.size;
  }
  return bytes;
}

}  // namespace tmsl
