// The C ABI the Python package calls through ctypes. Every function returns a status
// code (0 = success, else a tmsl::Code); the message and, for out-of-memory, the figures
// of the last failure on the calling thread are read with tmsl_last_error_*.
#pragma once

#include <cstddef>

#define TMSL_API extern "C" __attribute__((visibility("default")))

TMSL_API int tmsl_default_saver(void** out);
TMSL_API int tmsl_create_host_saver(size_t capacity_bytes, size_t granularity_bytes, void** out);
TMSL_API int tmsl_destroy_saver(void* saver);

// enable_cpu_backup: -1 = not given (the tag's setting; a new tag backs up graph memory
// only), 0 = off, 1 = on. A tag keeps the first explicit setting it was given.

// Checks that `tag` may take allocations (not paused, backup setting consistent), enters
// it in the saver's tag catalogue, and makes it the calling thread's region.
TMSL_API int tmsl_enter_region(void* saver, const char* tag, int enable_cpu_backup);
// Makes (saver, tag) the thread's region again without checks (leaving a nested region).
// saver == NULL: the thread leaves its region and follows the process defaults again
// (no region, unless TMSL_REGION_ALL_THREADS=1).
TMSL_API int tmsl_set_thread_region(void* saver, const char* tag, int enable_cpu_backup);
// The thread allocates outside any region, whatever the defaults say (saver.disable()).
TMSL_API int tmsl_disable_thread_region(void);

TMSL_API int tmsl_set_memory_margin(void* saver, size_t bytes);
TMSL_API int tmsl_set_retain_backups(void* saver, int retain);
// Fill resumed memory that has no backup with 0xFF bytes (NaN as floats); *out reads it.
TMSL_API int tmsl_set_poison_on_resume(void* saver, int poison);
TMSL_API int tmsl_get_poison_on_resume(void* saver, int* out);
// A CUDA graph capture is beginning on the calling thread: the tag of the thread's region
// (if any) holds graph memory from now on. No region: nothing to do.
TMSL_API int tmsl_note_graph_capture(void);
// *state: 0 = no region has used the tag, 1 = active, 2 = paused.
TMSL_API int tmsl_tag_state(void* saver, const char* tag, int* state);
// Returns once the backups resume let go of have been freed (that happens in the background).
TMSL_API int tmsl_wait_for_released_backups(void* saver);
// "" when the TMSL_* environment variables are valid, else what is wrong with them.
TMSL_API const char* tmsl_process_defaults_error(void);
// 1 when this library's cudaMalloc is the one the process calls (LD_PRELOAD in effect).
TMSL_API int tmsl_preload_active(void);

TMSL_API int tmsl_malloc(void* saver, size_t size, int device, const char* tag,
                         int enable_cpu_backup, void** out);
TMSL_API int tmsl_free(void* saver, void* ptr, void* stream);
// ntags < 0: every tag.
TMSL_API int tmsl_pause(void* saver, const char* const* tags, int ntags);
TMSL_API int tmsl_resume(void* saver, const char* const* tags, int ntags);

// Writes up to `capacity` bytes of JSON (NUL-terminated when it fits); *length is the
// full length without the NUL, so a caller can retry with a larger buffer.
TMSL_API int tmsl_stats_json(void* saver, char* buf, size_t capacity, size_t* length);
TMSL_API int tmsl_find_backup(void* saver, const void* ptr, size_t nbytes, const void** host);

// Test hook (host backend): the `after_calls`-th next call of `operation` fails.
TMSL_API int tmsl_inject_fault(void* saver, const char* operation, long after_calls);

TMSL_API int tmsl_last_error_code(void);
TMSL_API const char* tmsl_last_error_message(void);
TMSL_API void tmsl_last_error_oom(const char** tag, size_t* bytes_needed, size_t* bytes_free,
                                  int* device);
