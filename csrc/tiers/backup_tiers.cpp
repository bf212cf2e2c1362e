#include "tiers/backup_tiers.h"

#include <unistd.h>

#include <algorithm>

#include "node/host_limits.h"

namespace tmsl {

BackupTiers::BackupTiers(std::shared_ptr<Backend> backend, HostBudget& budget, ChunkStore* store,
                         bool keeps_host_cache)
    : backend_(std::move(backend)), budget_(budget), store_(store), cache_bytes_(default_cache_bytes(keeps_host_cache)),
      pool_(background_, gate_) {
  pool_.set_limit(cache_bytes_.load());
}

BackupTiers::~BackupTiers() { background_.wait_idle(); }

size_t BackupTiers::default_cache_bytes(bool keeps_host_cache) {
  // Like torch_memory_saver (TMSL_LIKE_TORCH_MEMORY_SAVER): a backup is freed at its resume.
  if (!keeps_host_cache) return 0;
  // Judged once per process: the available memory moves, and a default that changed
  // between two reads would be no setting at all.
  static const size_t chosen = [] {
    size_t memory = host_memory_limit();
    if (memory == 0) {
      const long pages = sysconf(_SC_PHYS_PAGES);
      const long page_size = sysconf(_SC_PAGESIZE);
      memory = pages > 0 && page_size > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page_size) : 0;
    }
    return std::min<size_t>(memory / 8, size_t{32} << 30);
  }();
  return chosen;
}

void BackupTiers::note_kept(size_t bytes, bool now) {
  const size_t budget = cache_bytes_.load();
  pool_.set_limit(bytes < budget ? budget - bytes : 0, now);
}

Status BackupTiers::host_memory(const std::vector<CopyRequest>& requests_in, bool urgent,
                                std::vector<HostBuffer>* out) {
  std::vector<HostBuffer> got(requests_in.size());
  std::vector<CopyRequest> requests = requests_in;
  for (size_t i = 0; i < requests.size(); ++i) {
    CopyRequest& r = requests[i];
    if (r.tier != Tier::kHost || r.soft_span == 0) continue;
    std::unique_ptr<HostArena> made;
    Status s = HostArena::create_soft(backend_, budget_, gate_, r.device, r.soft_span, &made);
    if (s.code == Code::kOutOfMemory) return s;  // (the budget: the caller makes room and asks again)
    if (!s.ok()) continue;  // a driver without such memory: an ordinary copy, below
    fresh_arenas_++;
    got[i] = HostBuffer{pool_.track(std::move(made), false), 0, r.bytes};
    r.tier = Tier::kKept;  // served: not the loop's below
  }
  for (int cacheable = 1; cacheable >= 0; --cacheable) {
    // By device: an arena is page-locked for one.
    std::vector<int> devices;
    for (const CopyRequest& r : requests) {
      if (r.tier == Tier::kHost && r.cacheable == (cacheable == 1) &&
          std::find(devices.begin(), devices.end(), r.device) == devices.end()) {
        devices.push_back(r.device);
      }
    }
    for (int device : devices) {
      std::vector<size_t> index, sizes;
      for (size_t i = 0; i < requests.size(); ++i) {
        const CopyRequest& r = requests[i];
        if (r.tier != Tier::kHost || r.cacheable != (cacheable == 1) || r.device != device) continue;
        index.push_back(i);
        sizes.push_back(r.bytes);
      }
      std::vector<HostBuffer> buffers(sizes.size());
      // "mmap" copies go back at resume: never the pool's memory, never back to it.
      if (cacheable == 1) pool_.take(device, sizes, &buffers);
      std::vector<size_t> fresh;
      for (size_t k = 0; k < sizes.size(); ++k) {
        if (!buffers[k]) fresh.push_back(sizes[k]);
      }
      if (!fresh.empty()) {
        std::unique_ptr<HostArena> made;
        Status s = HostArena::create(backend_, budget_, gate_, urgent, device, fresh, &made);
        if (s.code == Code::kOutOfMemory && urgent) {
          // (Only for a pause waiting for it: the preparation ahead runs on the background
          // thread itself, which must not wait for its own work.)
          // Memory this saver let go may still wait for a quiet moment to be freed (a program
          // pausing and resuming without a break): free it now, then try once more. (Not by
          // waiting for the background queue: a task there may wait for this pause's lock.)
          ForegroundGate::Flush flush(gate_);
          pool_.free_pending_now();
          s = HostArena::create(backend_, budget_, gate_, urgent, device, fresh, &made);
        }
        if (!s.ok()) return s;  // what the pool gave goes back to it
        fresh_arenas_++;
        std::shared_ptr<HostArena> arena = pool_.track(std::move(made), cacheable == 1);
        for (size_t k = 0, j = 0; k < sizes.size(); ++k) {
          if (!buffers[k]) buffers[k] = HostBuffer{arena, arena->buffer_offset(j++), sizes[k]};
        }
      }
      for (size_t k = 0; k < index.size(); ++k) got[index[k]] = std::move(buffers[k]);
    }
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests_in[i].tier == Tier::kHost) (*out)[i] = std::move(got[i]);
  }
  return Status::Ok();
}

size_t BackupTiers::spill_shortfall(size_t need, size_t cache_given_back, bool everything) {
  if (everything) return need;
  size_t room = budget_.room_with_others_caches();
  if (room != SIZE_MAX) room += cache_given_back;
  return need > room ? need - room : 0;
}

}  // namespace tmsl
