// The testing ABI: host-backend savers (the core's life cycle on Linux memory, for CI),
// direct allocation without torch, and fault injection. torch_mem_saver_lite.testing is
// its Python side; conventions as in c_api.h.
#pragma once

#include "api/c_api.h"

TMSL_API int tmsl_create_host_saver(size_t capacity_bytes, size_t granularity_bytes, void** out);
TMSL_API int tmsl_destroy_saver(void* saver);

TMSL_API int tmsl_malloc(void* saver, size_t size, int device, const char* tag,
                         int enable_cpu_backup, void** out);
TMSL_API int tmsl_free(void* saver, void* ptr, void* stream);

// Host backend only: the `after_calls`-th next call of `operation` fails, and the
// `times` - 1 calls after it.
TMSL_API int tmsl_inject_fault(void* saver, const char* operation, long after_calls, long times);

// The host memory limit the host cache's default budget is an eighth of (host_limits.h), read
// under `root` (a fake /proc and /sys/fs/cgroup tree in tests; "" for the real ones).
TMSL_API int tmsl_host_memory_limit(const char* root, size_t* out);
// The backup tiers (tiers/backup_tiers.h) as tests observe them: the bytes in the pool of
// page-locked host memory, how many fresh host arenas were made, how many times background
// host work gave way to the foreground, and how many background steps are waiting now.
TMSL_API int tmsl_tiers_figures(void* saver, size_t* pooled_bytes, size_t* fresh_arenas, size_t* deferrals,
                                size_t* waiting);
// hold 1: the saver's foreground counts as busy (as during an allocation or a pause) until
// a call with hold 0, so a test can watch what background host work does meanwhile.
TMSL_API int tmsl_hold_foreground(void* saver, int hold);

// How long a pause whose content changed waits for the other holders of its chunks in the
// node's store to pause too (BackupTiers::kPatienceForReplicas), in milliseconds: tests set
// it long, so that replicas pausing one after another rewrite their chunks in place whatever
// the machine's load.
TMSL_API int tmsl_set_patience_for_replicas(void* saver, long milliseconds);

// The content fingerprint (platform/fingerprint.h) under the key derived from `seed`, its 4
// lanes into lanes[0..3]: of `bytes` of host memory at `data` by the CPU half, or of the
// memory at `address` on `device` by the saver's backend (the GPU half on a CUDA saver).
TMSL_API int tmsl_fingerprint_host_bytes(const void* data, size_t bytes, uint64_t seed, uint64_t* lanes);
TMSL_API int tmsl_fingerprint_memory(void* saver, int device, const void* address, size_t bytes, uint64_t seed,
                                     uint64_t* lanes);
