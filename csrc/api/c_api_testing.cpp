#include "api/c_api_testing.h"
#include "api/node_budget.h"

#include "node/host_limits.h"

#include <unistd.h>

#include <algorithm>
#include <vector>

#include "api/abi_guard.h"
#include "platform/fingerprint.h"
#include "platform/tag_rules.h"

using namespace tmsl;

TMSL_API int tmsl_create_host_saver(size_t capacity_bytes, size_t granularity_bytes, void** out) {
  return guarded([&] {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    Status s = require(out != nullptr, "out must not be NULL");
    if (s.ok()) {
      s = require(granularity_bytes > 0 && granularity_bytes % page == 0,
                  "host granularity must be a positive multiple of the page size");
    }
    SaverHandle handle = 0;
    if (s.ok()) s = add_saver(std::make_unique<Saver>(make_host_backend(capacity_bytes, granularity_bytes), saver_setup()),
                              process_defaults(), &handle);
    if (s.ok()) *out = reinterpret_cast<void*>(handle);
    return s;
  });
}

TMSL_API int tmsl_destroy_saver(void* handle) {
  return guarded([&] {
    return in_forked_child() ? forked_child_error() : remove_saver(reinterpret_cast<SaverHandle>(handle));
  });
}

TMSL_API int tmsl_malloc(void* handle, size_t size, int device, const char* tag,
                         int enable_cpu_backup, void** out) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = check_tag(tag);
    if (s.ok()) s = require(out != nullptr, "out must not be NULL");
    if (s.ok()) s = require(enable_cpu_backup >= -1 && enable_cpu_backup <= kMaxBackupChoice,
                                  "enable_cpu_backup must be a backup choice from -1 to 3 (c_api.h)");
    if (!s.ok()) return s;
    uintptr_t va = 0;
    s = saver.allocate(size, device, tag, static_cast<BackupChoice>(enable_cpu_backup), &va);
    if (s.ok()) *out = reinterpret_cast<void*>(va);
    return s;
  });
}

TMSL_API int tmsl_free(void* handle, void* ptr, void* stream) {
  return on_saver(handle, [&](Saver& saver) { return saver.free(reinterpret_cast<uintptr_t>(ptr), stream); });
}

TMSL_API int tmsl_inject_fault(void* handle, const char* operation, long after_calls, long times) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(operation != nullptr, "operation must not be NULL");
    return s.ok() ? inject_host_fault(saver.backend(), operation, after_calls, times) : s;
  });
}

TMSL_API int tmsl_tiers_figures(void* handle, size_t* pooled_bytes, size_t* fresh_arenas, size_t* deferrals,
                                size_t* waiting) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(pooled_bytes != nullptr && fresh_arenas != nullptr && deferrals != nullptr && waiting != nullptr,
                       "out pointers must not be NULL");
    if (!s.ok()) return s;
    BackupTiers& tiers = saver.tiers();
    *pooled_bytes = tiers.pool().bytes();
    *fresh_arenas = tiers.fresh_arenas();
    *deferrals = tiers.gate().deferrals();
    *waiting = tiers.gate().waiting();
    return s;
  });
}

TMSL_API int tmsl_hold_foreground(void* handle, int hold) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(hold == 0 || hold == 1, "hold must be 0 or 1");
    if (!s.ok()) return s;
    if (hold == 1) {
      saver.tiers().gate().enter();
    } else {
      saver.tiers().gate().leave();
    }
    return s;
  });
}

TMSL_API int tmsl_set_patience_for_replicas(void* handle, long milliseconds) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(milliseconds >= 0, "milliseconds must not be negative");
    if (s.ok()) saver.tiers().set_patience_for_replicas(std::chrono::milliseconds(milliseconds));
    return s;
  });
}

TMSL_API int tmsl_host_memory_limit(const char* root, size_t* out) {
  return guarded([&] {
    Status s = require(root != nullptr && out != nullptr, "root and out must not be NULL");
    if (s.ok()) *out = host_memory_limit(root);
    return s;
  });
}

namespace {
Status check_fingerprint_request(const void* data, size_t bytes, const uint64_t* lanes) {
  Status s = require(data != nullptr && lanes != nullptr, "data and lanes must not be NULL");
  if (s.ok()) s = require(fingerprintable(bytes), "bytes must be a positive multiple of 1024");
  return s;
}
}  // namespace

TMSL_API int tmsl_fingerprint_host_bytes(const void* data, size_t bytes, uint64_t seed, uint64_t* lanes) {
  return guarded([&] {
    Status s = check_fingerprint_request(data, bytes, lanes);
    if (!s.ok()) return s;
    const Fingerprint f = fingerprint_bytes(static_cast<const char*>(data), bytes, FingerprintKey::from_seed(seed));
    std::copy(f.lanes, f.lanes + kFingerprintLanes, lanes);
    return s;
  });
}

TMSL_API int tmsl_fingerprint_memory(void* handle, int device, const void* address, size_t bytes, uint64_t seed,
                                     uint64_t* lanes) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = check_fingerprint_request(address, bytes, lanes);
    if (!s.ok()) return s;
    const FingerprintKey key = FingerprintKey::from_seed(seed);
    std::vector<uint64_t> segments(fingerprint_segments_in(bytes) * kFingerprintLanes);
    s = saver.backend().fingerprint(device, reinterpret_cast<uintptr_t>(address), bytes, key, segments.data());
    if (!s.ok()) return s;
    const Fingerprint f = join_segments(segments.data(), bytes, key);
    std::copy(f.lanes, f.lanes + kFingerprintLanes, lanes);
    return s;
  });
}
