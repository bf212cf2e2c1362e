// The host cache's policy: which copies stay page-locked after a resume (the budget,
// cache_bytes: the newest stay, older cached arenas give way), stale cached copies handed to a
// pause short of page-locked memory, the figure the node's ledger is told (what could be given
// back at once), and giving cached memory back when the budget shrinks, is released, or
// another process asks. The copies are HostCopies'; what a copy's tag allows is pushed in by
// the saver (HostCopies::Resumed).
#include <algorithm>
#include <map>
#include <set>

#include "tiers/backup_tiers.h"

namespace tmsl {

bool BackupTiers::keep_after_resume(const std::vector<HostCopies::Resumed>& batch, bool retain,
                                    std::vector<HostBuffer>* older) {
  if (retain) return true;
  std::vector<uintptr_t> vas;
  vas.reserve(batch.size());
  for (const HostCopies::Resumed& r : batch) vas.push_back(r.va);
  std::vector<HostBuffer> copies = copies_.peek(vas);
  std::vector<HostBuffer> kept;  // what this batch would add to the cache ("mmap" tags add nothing)
  std::set<const HostArena*> arenas;
  size_t bytes = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const HostBuffer& copy = copies[i];
    if (!copy || !HostCopies::cached_after_resume(copy, batch[i].cacheable, false)) continue;
    kept.push_back(copy);
    if (arenas.insert(copy.arena.get()).second) bytes += copy.arena->used_bytes();
  }
  const size_t budget = cache_bytes();
  if (kept.empty() || bytes > budget) return false;
  // The batch is still moving: the older arenas are the only ones take_cache may take.
  const size_t cached = copies_.cached_bytes(kept);
  if (cached > budget) *older = copies_.take_cache(cached - budget);
  return true;
}

std::vector<HostBuffer> BackupTiers::take_stale_cache(const std::vector<CopyRequest>& requests) {
  std::map<int, size_t> missing;  // by device: what the pause needs beyond what the pool holds
  for (const CopyRequest& r : requests) {
    // (A soft copy is made by the driver: no pooled or cached memory serves it.)
    if (r.tier == Tier::kHost && r.cacheable && r.soft_span == 0) missing[r.device] += r.bytes;
  }
  size_t short_of = 0;
  for (auto& [device, bytes] : missing) {
    bytes -= std::min(bytes, pool_.bytes_on(device));
    short_of += bytes;
  }
  // Where the cache's budget holds fresh memory beside what it keeps, both stay: each tag's
  // next pause finds its own copy (and fresh memory is set aside ahead where it can be).
  if (short_of == 0 || copies_.cached_bytes() + pool_.bytes() + short_of <= cache_bytes()) return {};
  // Faulting in and page-locking fresh memory runs at half the link's speed or less; memory
  // already page-locked runs at its full speed, and the cache ends up holding the newest copies.
  std::vector<HostBuffer> taken = copies_.take_cached_for(&missing);
  // The pool may hold what the cache no longer keeps.
  if (!taken.empty()) note_kept(copies_.cached_bytes());
  return taken;
}

void BackupTiers::publish_cache() {
  // What a request of another process would get back: whole cached arenas (retained copies
  // and paused allocations' backups stay) and the pool, which keeps what the budget leaves
  // beside the copies kept.
  size_t evictable = copies_.cached_arena_bytes();
  note_kept(copies_.cached_bytes());
  evictable += pool_.bytes();
  // The ledger takes the node's lock.
  if (published_cache_.exchange(evictable) != evictable) budget_.note_cached(this, evictable);
  // And how much of the node's store this process maps (its copies held once by the node).
  const size_t mapped = copies_.store_bytes();
  if (published_shared_.exchange(mapped) != mapped) budget_.note_shared(this, mapped);
}

void BackupTiers::give_cache_back(std::unique_lock<std::mutex> op) {
  {
    HostPool::FreeNow now(pool_);
    std::vector<HostBuffer> let_go = copies_.take_cache(SIZE_MAX);
    note_kept(SIZE_MAX, true);
    op.unlock();
    let_go.clear();  // here, at once: the process that asked is waiting for the bytes
  }
  publish_cache();
}

void BackupTiers::release_cache() {
  std::vector<HostBuffer> let_go = copies_.take_resident();
  note_kept(SIZE_MAX);  // the pool lets go of everything too
  let_go.clear();  // (their arenas come back to the pool, which frees them in the background)
  publish_cache();
}

void BackupTiers::fit_cache() {
  const size_t budget = cache_bytes();
  std::vector<HostBuffer> let_go;
  const size_t cached = copies_.cached_bytes();
  if (cached > budget) let_go = copies_.take_cache(cached - budget);
  note_kept(SIZE_MAX);  // what is let go does not stay in the pool either
  let_go.clear();  // back to the pool, which lets it go: the lowered budget applies at once
  publish_cache();
}

Status BackupTiers::with_room(size_t bytes, const std::function<Status()>& attempt) {
  Status s = attempt();
  if (s.code == Code::kOutOfMemory) {
    HostPool::FreeNow now(pool_);  // the retry needs the bytes back at once
    note_kept(SIZE_MAX, true);
    s = attempt();
    while (s.code == Code::kOutOfMemory) {
      std::vector<HostBuffer> let_go = copies_.take_cache(1);
      if (let_go.empty()) break;
      let_go.clear();
      s = attempt();
    }
  }
  if (s.code == Code::kOutOfMemory && budget_.ask_others_for(bytes, kPatienceForOthers)) s = attempt();
  return s;
}

}  // namespace tmsl
