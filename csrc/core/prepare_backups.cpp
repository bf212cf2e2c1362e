// The saver's side of the host cache, whose policy and copies are the tiers'
// (tiers/host_cache.cpp, tiers/host_copies.h): host memory set aside ahead of a pause
// (prepare_backups, run in the background) for the tags it names, and the cache's settings
// and requests, each under the operation lock so that no pause is reusing cached copies
// meanwhile. The queue of tags to prepare has a lock of its own (prepare_mu_); the table is
// read under mu_ as everywhere else.
#include "core/saver.h"

#include <algorithm>

namespace tmsl {

Status Saver::prepare_backups(const TagSelection& selection) {
  {
    std::lock_guard<std::mutex> lock(prepare_mu_);
    prepare_pending_.all = prepare_pending_.all || selection.all;
    prepare_pending_.tags.insert(selection.tags.begin(), selection.tags.end());
    if (prepare_queued_) return Status::Ok();  // the queued task takes these tags too
    prepare_queued_ = true;
  }
  tiers_.background().run([this] { prepare_pending(); });
  return Status::Ok();
}

void Saver::prepare_pending() {
  TagSelection selection;
  {
    std::lock_guard<std::mutex> lock(prepare_mu_);
    selection = std::move(prepare_pending_);
    prepare_pending_ = TagSelection{false, {}};
    prepare_queued_ = false;
  }
  // One preparation at a time: the regions that close meanwhile are taken together next,
  // into one arena, instead of each starting its own workers.
  for (const std::shared_ptr<HostArena>& arena : prepare_backups_now(selection)) arena->wait_prepared();
  share_ahead(selection);
  tiers_.publish_cache();
}

std::vector<std::shared_ptr<HostArena>> Saver::prepare_backups_now(const TagSelection& selection) {
  std::vector<std::shared_ptr<HostArena>> arenas;
  if (tiers_.closing()) return arenas;
  std::lock_guard<std::mutex> op(op_mu_);  // no pause, resume or cache release meanwhile
  struct Wanted {
    uintptr_t va;
    size_t size;
    std::string tag;
    size_t soft_span;  // a soft pause's copy (its allocation's reserved bytes), else 0
  };
  std::map<int, std::vector<Wanted>> wanted;  // by device
  // Whether `a` is resident, backed up, may keep its backup cached and has none yet (the
  // tiers hold no copy of it: `copies`, their addresses in order). Needs mu_.
  const bool retain = options_.flag(Option::kRetainCpuBackup);
  // A backup the node's store takes needs no memory of this process's set aside (one alone on
  // the node copies privately: memory set aside, as with sharing off).
  const FingerprintKey* key = tiers_.store_key_now();
  auto wants = [&](const Allocation& a, const std::vector<std::pair<uintptr_t, size_t>>& copies) {
    if (content_addressed(a, key) && !soft_pauses(*a.tag_info)) return false;  // (a soft tag's are never shared)
    auto has_copy = std::lower_bound(copies.begin(), copies.end(), std::make_pair(a.va, size_t{0}));
    if (has_copy != copies.end() && has_copy->first == a.va) return false;
    return a.state == State::kActive && a.backs_up() && (retain || resumed(a).cacheable);
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto copies = tiers_.copies().sizes();
    size_t bytes = 0;
    auto want = [&](const Allocation& a) {
      if (!wants(a, copies)) return;
      // (A soft copy is made by the driver, slowly: here, during the rollout, not at the pause.)
      wanted[a.device].push_back(Wanted{a.va, a.backup_bytes(), a.tag, soft_pauses(*a.tag_info) ? a.size : 0});
      bytes += a.backup_bytes();
    };
    for_each_selected(selection, want);
    // No room beside the cache: the first pause takes stale cached copies itself.
    const size_t budget = tiers_.cache_bytes(), cached = tiers_.copies().cached_bytes();
    if (bytes == 0 || bytes > budget || cached > budget - bytes) return arenas;
  }
  for (const auto& entry : wanted) {
    // The pool's memory first (ready at once), fresh memory that gives way to the foreground
    // for the rest.
    std::vector<CopyRequest> requests;
    for (const Wanted& w : entry.second) {
      requests.push_back(CopyRequest{entry.first, w.size, true, Tier::kHost, w.soft_span});
    }
    std::vector<HostBuffer> buffers(requests.size());
    // (The driver makes soft copies slowly, seconds for large ones, under the operation lock: a
    // pause meanwhile waits for them and takes them, instead of making its own beside them.)
    if (!tiers_.host_memory(requests, false, &buffers).ok()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    const auto copies = tiers_.copies().sizes();
    for (size_t k = 0; k < entry.second.size(); ++k) {
      const Wanted& w = entry.second[k];
      // Freed meanwhile (its buffer goes with the arena), or its address reused by another
      // allocation, which gets a buffer only if it is still one that wants it.
      auto it = table_.find(w.va);
      if (it == table_.end()) continue;
      Allocation& a = it->second;
      if (a.backup_bytes() == w.size && a.tag == w.tag && wants(a, copies)) {
        // Set aside for the next pause (resident, not retained: nothing to hand out yet).
        tiers_.copies().put_if_absent(a.va, buffers[k], a.device, CopyState::kResident);
      }
      if (arenas.empty() || arenas.back() != buffers[k].arena) arenas.push_back(buffers[k].arena);
    }
  }
  return arenas;
}

void Saver::release_host_cache() {
  tiers_.background().wait_idle();  // a preparation asked for before this call does not refill it after
  ForegroundOp op(*this);  // no pause is reusing these meanwhile
  tiers_.release_cache();
}

void Saver::set_host_cache_bytes(size_t bytes) {
  tiers_.set_cache_bytes(bytes);
  ForegroundOp op(*this);  // no pause is reusing these meanwhile
  tiers_.fit_cache();
}

void Saver::give_cache_back_on_request() {
  std::unique_lock<std::mutex> op(op_mu_, std::try_to_lock);
  if (!op.owns_lock()) return;  // the saver is busy: the ledger asks again shortly
  tiers_.give_cache_back(std::move(op));
}

}  // namespace tmsl
