// The disk tier of the node's host-memory budget: when a pause needs more host memory than
// the budget could give even with the host caches given back, the saver's largest backed-up
// allocations go to disk files for that pause instead (written and read by the disk tier
// or, until Python is switched over, by the Python side, as for regions with disk
// backup), and come back to host backups once resumed.
#include <algorithm>
#include <set>

#include "core/saver.h"

namespace tmsl {

Status Saver::mark_spill(const TagSelection& selection, bool everything, size_t* bytes) {
  ForegroundOp op(*this);  // no pause is choosing host memory meanwhile (nor freeing what it reuses)
  {
    std::lock_guard<std::mutex> lock(mu_);
    Status s = check_known(selection);
    if (!s.ok()) return s;
  }
  *bytes = choose_spill(selection, everything, false);
  return Status::Ok();
}

size_t Saver::choose_spill(const TagSelection& selection, bool everything, bool written) {
  // Under op_mu_: no other pause chooses host memory meanwhile, nor frees what this one
  // reuses. Backed-up resident allocations that would take new host memory at
  // this pause, and the arenas it takes copies from (not given back). Needs mu_.
  auto candidates_of = [&](std::vector<Allocation*>* candidates, std::set<const HostArena*>* reused) {
    size_t need = 0;
    for_each_selected(selection, [&](Allocation& a) {
      if (a.state == State::kActive) a.disk_marked = a.spill_written = false;  // judged afresh
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
    a->spill_written = written;
    freed += a->backup_bytes();
    bytes += a->size;
    any_marked_.store(true);
  }
  return bytes;
}

Status Saver::note_spill_written(const std::vector<uintptr_t>& addresses) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uintptr_t va : addresses) {
    auto it = table_.find(va);
    if (it != table_.end() && it->second.disk_marked && it->second.state == State::kActive) {
      it->second.spill_written = true;
    }
  }
  return Status::Ok();
}

Status Saver::unmark_spill(const TagSelection& selection) {
  if (!any_marked_.load()) return Status::Ok();  // every resume calls it
  ForegroundOp op(*this);  // not under a pause that has chosen its backups
  std::lock_guard<std::mutex> lock(mu_);
  bool still_marked = false;
  for (auto& entry : table_) {
    Allocation& a = entry.second;
    if (!a.disk_marked) continue;
    if (a.state == State::kActive && selection.matches(a.tag)) {
      a.disk_marked = a.spill_written = false;
    } else {
      still_marked = true;
    }
  }
  any_marked_.store(still_marked);
  return Status::Ok();
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
