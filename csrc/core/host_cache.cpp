// The saver's host-cache policy: which backups stay page-locked after a resume (the budget,
// host_cache_bytes), host memory set aside ahead of a first pause (prepare_backups, run in
// the background), a full cache's memory handed to a pause of the same shape (recycle_cache),
// and giving cached memory back when the budget shrinks or is released.
// Its queue of tags to prepare has a lock of its own (prepare_mu_); the table is read under
// mu_ as everywhere else.
#include "core/saver.h"

#include <algorithm>

namespace tmsl {

bool Saver::cached_after_resume(const Allocation& a, State state) const {
  if (a.host_copy && a.host_copy.arena->has_shared()) return false;  // shared: never written again
  if (state != State::kActive || retain_backups_.load()) return true;
  return a.choice != BackupChoice::kOnUncached && a.tag_info->caches_backups;
}

bool Saver::keeps_backups(const std::vector<Allocation*>& batch, std::vector<HostBuffer>* older) {
  if (retain_backups_.load()) return true;
  std::vector<const HostBuffer*> kept;  // what this batch would add to the cache ("mmap" tags add nothing)
  std::set<const HostArena*> arenas;
  size_t bytes = 0;
  for (const Allocation* a : batch) {
    if (!a->host_copy || !cached_after_resume(*a, State::kActive)) continue;
    kept.push_back(&a->host_copy);
    if (arenas.insert(a->host_copy.arena.get()).second) bytes += a->host_copy.arena->used_bytes();
  }
  const size_t budget = tiers_.cache_bytes();
  if (kept.empty() || bytes > budget) return false;
  // The batch is still resuming: the older arenas are the only ones take_cache may take.
  const size_t cached = cached_bytes(kept);
  if (cached > budget) *older = take_cache(cached - budget);
  return true;
}

size_t Saver::cached_bytes(const std::vector<const HostBuffer*>& more) const {
  std::set<const HostArena*> arenas;
  size_t bytes = 0;
  auto count = [&](const HostBuffer& buffer) {
    if (buffer && arenas.insert(buffer.arena.get()).second) bytes += buffer.arena->used_bytes();
  };
  for (const auto& entry : table_) {
    if (entry.second.state == State::kActive) count(entry.second.host_copy);
  }
  for (const HostBuffer* buffer : more) count(*buffer);
  return bytes;
}

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
  publish_cache();
}

std::vector<std::shared_ptr<HostArena>> Saver::prepare_backups_now(const TagSelection& selection) {
  std::vector<std::shared_ptr<HostArena>> arenas;
  if (closing_.load()) return arenas;
  std::lock_guard<std::mutex> op(op_mu_);  // no pause, resume or cache release meanwhile
  struct Wanted {
    uintptr_t va;
    size_t size;
    std::string tag;
  };
  std::map<int, std::vector<Wanted>> wanted;  // by device
  // Whether `a` is resident, backed up, may keep its backup cached and has none yet. Needs mu_.
  auto wants = [this](const Allocation& a) {
    return a.state == State::kActive && !a.host_copy && a.backs_up() && cached_after_resume(a, State::kActive);
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    size_t bytes = 0;
    auto want = [&](const Allocation& a) {
      if (!wants(a)) return;
      wanted[a.device].push_back(Wanted{a.va, a.backup_bytes(), a.tag});
      bytes += a.backup_bytes();
    };
    for_each_selected(selection, want);
    // No room beside the cache: the first pause takes stale cached copies itself.
    const size_t budget = tiers_.cache_bytes(), cached = cached_bytes({});
    if (bytes == 0 || bytes > budget || cached > budget - bytes) return arenas;
  }
  for (const auto& entry : wanted) {
    // The pool's memory first (ready at once), fresh memory that gives way to the foreground
    // for the rest.
    std::vector<CopyRequest> requests;
    for (const Wanted& w : entry.second) requests.push_back(CopyRequest{entry.first, w.size, true, Tier::kHost});
    std::vector<HostBuffer> buffers(requests.size());
    if (!tiers_.host_memory(requests, false, &buffers).ok()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < entry.second.size(); ++k) {
      const Wanted& w = entry.second[k];
      // Freed meanwhile (its buffer goes with the arena), or its address reused by another
      // allocation, which gets a buffer only if it is still one that wants it.
      auto it = table_.find(w.va);
      if (it == table_.end()) continue;
      Allocation& a = it->second;
      if (a.backup_bytes() == w.size && a.tag == w.tag && wants(a)) {
        a.host_copy = buffers[k];
        a.retained = false;  // set aside for the next pause: nothing to hand out yet
      }
      if (arenas.empty() || arenas.back() != buffers[k].arena) arenas.push_back(buffers[k].arena);
    }
  }
  return arenas;
}

void Saver::release_host_cache() {
  {
    Waiting waiting(foreground_waiting_);  // a sharing pass queued before it ends early
    tiers_.background().wait_idle();  // a preparation asked for before this call does not refill it after
  }
  ForegroundOp op(*this);  // no pause is reusing these meanwhile
  std::vector<HostBuffer> let_go;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : table_) {
      Allocation& a = entry.second;
      if (a.state == State::kActive && a.host_copy) {
        let_go.push_back(std::move(a.host_copy));
        a.retained = false;
      }
    }
    tiers_.note_kept(SIZE_MAX);  // the pool lets go of everything too
  }
  let_go.clear();  // (their arenas come back to the pool, which frees them in the background)
  publish_cache();
}

void Saver::set_host_cache_bytes(size_t bytes) {
  tiers_.set_cache_bytes(bytes);
  ForegroundOp op(*this);  // no pause is reusing these meanwhile
  std::vector<HostBuffer> let_go;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t cached = cached_bytes({});
    if (cached > bytes) let_go = take_cache(cached - bytes);
    tiers_.note_kept(SIZE_MAX);  // what is let go does not stay in the pool either
  }
  let_go.clear();  // back to the pool, which lets it go: the lowered budget applies at once
  publish_cache();
}

void Saver::publish_cache() {
  // Under mu_, so that the figure last told is the table's latest: what a request of another
  // process would get back (retained copies and paused allocations' backups stay).
  size_t evictable = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : cached_arenas()) evictable += entry.first->used_bytes();
    // The pool keeps what the budget leaves beside the copies kept.
    tiers_.note_kept(cached_bytes({}));
    evictable += tiers_.pool().bytes();
  }
  // Off the table lock: the ledger takes the node's lock.
  if (published_cache_.exchange(evictable) != evictable) tiers_.budget().note_cached(this, evictable);
}

void Saver::give_cache_back_on_request() {
  std::unique_lock<std::mutex> op(op_mu_, std::try_to_lock);
  if (!op.owns_lock()) {
    cache_wanted_.store(true);  // a sharing pass holding it stops; the ledger asks again shortly
    return;
  }
  std::vector<HostBuffer> let_go;
  {
    HostPool::FreeNow now(tiers_.pool());
    {
      std::lock_guard<std::mutex> lock(mu_);
      let_go = take_cache(SIZE_MAX);
    }
    tiers_.note_kept(SIZE_MAX, true);
    op.unlock();
    let_go.clear();  // here, at once: the process that asked is waiting for the bytes
  }
  publish_cache();
}

std::vector<std::pair<HostArena*, std::vector<Saver::Allocation*>>> Saver::cached_arenas() {
  // Arenas whose every copy is a resident allocation's cached one (retained copies stay,
  // whatever the size; a paused allocation's backup is not cache).
  std::map<HostArena*, std::vector<Allocation*>> holders;
  std::set<const HostArena*> kept;
  for (auto& entry : table_) {
    Allocation& a = entry.second;
    if (!a.host_copy) continue;
    if (a.state == State::kActive && !a.retained) {
      holders[a.host_copy.arena.get()].push_back(&a);
    } else {
      kept.insert(a.host_copy.arena.get());
    }
  }
  std::vector<std::pair<HostArena*, std::vector<Allocation*>>> arenas;
  for (auto& entry : holders) {
    if (kept.count(entry.first) == 0) arenas.emplace_back(entry.first, std::move(entry.second));
  }
  std::sort(arenas.begin(), arenas.end(),
            [](const auto& a, const auto& b) { return a.first->last_use() < b.first->last_use(); });
  return arenas;
}

std::vector<HostBuffer> Saver::take_cache(size_t bytes) {
  std::vector<HostBuffer> let_go;
  size_t taken = 0;
  for (auto& [arena, allocations] : cached_arenas()) {
    if (taken >= bytes) break;
    taken += arena->used_bytes();
    for (Allocation* a : allocations) let_go.push_back(std::move(a->host_copy));
  }
  return let_go;
}

std::vector<HostBuffer> Saver::take_stale_cache(const std::vector<CopyRequest>& requests) {
  std::map<int, size_t> missing;  // by device: what the pause needs beyond what the pool holds
  for (const CopyRequest& r : requests) {
    if (r.tier == Tier::kHost && r.cacheable) missing[r.device] += r.bytes;
  }
  size_t short_of = 0;
  for (auto& [device, bytes] : missing) {
    bytes -= std::min(bytes, tiers_.pool().bytes_on(device));
    short_of += bytes;
  }
  std::vector<HostBuffer> taken;
  // Where the cache's budget holds fresh memory beside what it keeps, both stay: each tag's
  // next pause finds its own copy (and fresh memory is set aside ahead where it can be).
  if (short_of == 0 || cached_bytes({}) + tiers_.pool().bytes() + short_of <= tiers_.cache_bytes()) return taken;
  // Faulting in and page-locking fresh memory runs at half the link's speed or less; memory
  // already page-locked runs at its full speed, and the cache ends up holding the newest copies.
  for (auto& [arena, allocations] : cached_arenas()) {
    auto it = missing.find(arena->device());
    if (it == missing.end() || it->second == 0 || !arena->poolable()) continue;
    for (Allocation* a : allocations) taken.push_back(std::move(a->host_copy));
    it->second -= std::min(it->second, arena->used_bytes());
  }
  // The pool may hold what the cache no longer keeps.
  if (!taken.empty()) tiers_.note_kept(cached_bytes({}));
  return taken;
}

}  // namespace tmsl
