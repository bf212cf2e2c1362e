#include "tiers/host_copies.h"

#include <algorithm>
#include <set>

namespace tmsl {

HostBuffer HostCopies::put(uintptr_t va, HostBuffer copy, int device, CopyState state) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[va];
  HostBuffer old = std::move(e.copy);
  e.copy = std::move(copy);
  e.state = state;
  e.retained = false;
  e.device = device;
  return old;
}

bool HostCopies::put_if_absent(uintptr_t va, HostBuffer& copy, int device, CopyState state) {
  std::lock_guard<std::mutex> lock(mu_);
  auto inserted = entries_.try_emplace(va);
  if (!inserted.second) return false;
  Entry& e = inserted.first->second;
  e.copy = copy;
  e.state = state;
  e.device = device;
  return true;
}

HostBuffer HostCopies::take(uintptr_t va) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(va);
  if (it == entries_.end()) return HostBuffer();
  HostBuffer copy = std::move(it->second.copy);
  entries_.erase(it);
  return copy;
}

std::vector<HostBuffer> HostCopies::peek(const std::vector<uintptr_t>& vas) {
  std::vector<HostBuffer> out(vas.size());
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.empty()) return out;
  for (size_t i = 0; i < vas.size(); ++i) {
    auto it = entries_.find(vas[i]);
    if (it != entries_.end()) out[i] = it->second.copy;
  }
  return out;
}

void HostCopies::note_state(const std::vector<uintptr_t>& vas, CopyState state) {
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.empty()) return;
  for (uintptr_t va : vas) {
    auto it = entries_.find(va);
    if (it != entries_.end()) it->second.state = state;
  }
}

void HostCopies::settle_pause(const std::vector<uintptr_t>& vas, const std::vector<int>& devices, size_t done,
                              std::vector<HostBuffer>* backups, std::vector<HostBuffer>* let_go) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < vas.size(); ++i) {
      if (i >= done) {
        auto it = entries_.find(vas[i]);
        if (it != entries_.end()) it->second.state = CopyState::kResident;
        continue;
      }
      HostBuffer& backup = (*backups)[i];
      if (!backup) {
        auto it = entries_.find(vas[i]);
        if (it == entries_.end()) continue;
        let_go->push_back(std::move(it->second.copy));  // released without a copy: an old one is done with
        entries_.erase(it);
        continue;
      }
      Entry& e = entries_[vas[i]];
      if (e.copy) let_go->push_back(std::move(e.copy));
      e.copy = std::move(backup);
      e.state = CopyState::kPaused;
      e.retained = false;
      e.device = devices[i];
    }
  }
  for (HostBuffer& unused : *backups) {
    if (unused) let_go->push_back(std::move(unused));
  }
}

void HostCopies::settle_resume(const std::vector<Resumed>& batch, size_t done, bool drop, bool retain,
                               bool keep_content, std::vector<HostBuffer>* let_go, std::vector<HostBuffer>* free_now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.empty()) return;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Resumed& r = batch[i];
    auto it = entries_.find(r.va);
    if (it == entries_.end()) continue;
    Entry& e = it->second;
    if (i >= done) {
      e.state = CopyState::kPaused;
      continue;
    }
    e.state = CopyState::kResident;
    const bool content = keep_content && e.copy && e.copy.arena->is_content();
    if ((drop && !content) || !cached_after_resume(e.copy, r.cacheable, retain)) {
      (r.uncached ? free_now : let_go)->push_back(std::move(e.copy));
      entries_.erase(it);
    } else {
      e.retained = retain;
    }
  }
}

HostBuffer HostCopies::lease(uintptr_t va, bool paused, bool* has_copy) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(va);
  *has_copy = it != entries_.end();
  if (!*has_copy) return HostBuffer();
  // Resident, a copy kept by the cache is stale; one kept by retention is handed out, as
  // torch_memory_saver does (its content is that of the last pause).
  if (!paused && !it->second.retained) return HostBuffer();
  return it->second.copy;
}

std::vector<HostBuffer> HostCopies::take_resident() {
  std::vector<HostBuffer> taken;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.state == CopyState::kResident) {
      taken.push_back(std::move(it->second.copy));
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  return taken;
}

std::vector<std::pair<uintptr_t, size_t>> HostCopies::sizes() const {
  std::vector<std::pair<uintptr_t, size_t>> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.reserve(entries_.size());
  for (const auto& entry : entries_) out.emplace_back(entry.first, entry.second.copy.size);
  return out;
}

std::vector<uintptr_t> HostCopies::in_store() const {
  std::vector<uintptr_t> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& entry : entries_) {
    if (entry.second.copy && entry.second.copy.arena->is_content()) out.push_back(entry.first);
  }
  return out;
}

size_t HostCopies::total_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (const auto& entry : entries_) bytes += entry.second.copy.size;
  return bytes;
}

size_t HostCopies::store_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<const HostArena*> arenas;
  size_t bytes = 0;
  for (const auto& entry : entries_) {
    const HostBuffer& copy = entry.second.copy;
    if (copy && copy.arena->is_content() && arenas.insert(copy.arena.get()).second) {
      bytes += copy.arena->used_bytes() - copy.arena->own_bytes();
    }
  }
  return bytes;
}

size_t HostCopies::cached_bytes(const std::vector<HostBuffer>& more) const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_locked(more);
}

size_t HostCopies::cached_bytes_locked(const std::vector<HostBuffer>& more) const {
  std::set<const HostArena*> arenas;
  size_t bytes = 0;
  auto count = [&](const HostBuffer& buffer) {
    if (buffer && arenas.insert(buffer.arena.get()).second) bytes += buffer.arena->own_bytes();
  };
  for (const auto& entry : entries_) {
    if (entry.second.state == CopyState::kResident) count(entry.second.copy);
  }
  for (const HostBuffer& buffer : more) count(buffer);
  return bytes;
}

size_t HostCopies::cached_arena_bytes(const std::set<const HostArena*>& except) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (const CachedArena& cached : cached_arenas_locked()) {
    if (except.count(cached.arena) == 0) bytes += cached.arena->own_bytes();
  }
  return bytes;
}

std::vector<HostCopies::CachedArena> HostCopies::cached_arenas_locked() const {
  // Arenas whose every copy is a resident allocation's cached one (retained copies stay,
  // whatever the size; a paused allocation's backup, or one a pause or resume is moving, is
  // not cache).
  std::map<HostArena*, std::vector<uintptr_t>> holders;
  std::set<const HostArena*> kept;
  for (const auto& entry : entries_) {
    const Entry& e = entry.second;
    if (!e.copy) continue;
    if (e.state == CopyState::kResident && !e.retained) {
      holders[e.copy.arena.get()].push_back(entry.first);
    } else {
      kept.insert(e.copy.arena.get());
    }
  }
  std::vector<CachedArena> arenas;
  for (auto& entry : holders) {
    if (kept.count(entry.first) == 0) arenas.push_back(CachedArena{entry.first, std::move(entry.second)});
  }
  std::sort(arenas.begin(), arenas.end(),
            [](const CachedArena& a, const CachedArena& b) { return a.arena->last_use() < b.arena->last_use(); });
  return arenas;
}

std::vector<HostBuffer> HostCopies::take_cache(size_t bytes) {
  std::vector<HostBuffer> let_go;
  size_t taken = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (CachedArena& cached : cached_arenas_locked()) {
    if (taken >= bytes) break;
    taken += cached.arena->own_bytes();
    for (uintptr_t va : cached.holders) {
      auto it = entries_.find(va);
      let_go.push_back(std::move(it->second.copy));
      entries_.erase(it);
    }
  }
  return let_go;
}

std::vector<HostBuffer> HostCopies::take_cached_for(std::map<int, size_t>* missing) {
  std::vector<HostBuffer> taken;
  std::lock_guard<std::mutex> lock(mu_);
  for (CachedArena& cached : cached_arenas_locked()) {
    auto it = missing->find(cached.arena->device());
    if (it == missing->end() || it->second == 0 || !cached.arena->poolable()) continue;
    it->second -= std::min(it->second, cached.arena->used_bytes());
    for (uintptr_t va : cached.holders) {
      auto e = entries_.find(va);
      taken.push_back(std::move(e->second.copy));
      entries_.erase(e);
    }
  }
  return taken;
}

}  // namespace tmsl
