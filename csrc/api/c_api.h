// The library's whole production ABI: what the Python package calls through ctypes, and
// the allocation hooks torch or the dynamic linker call. The testing ABI (host savers,
// direct allocation, fault injection) is in c_api_testing.h.
//
// Functions returning int return a status code (0 = success; tmsl_status_names() names
// them in order); the message and, for out-of-memory, the figures of the calling thread's
// last failure are read with tmsl_last_error_*. A saver is named by an opaque handle.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#define TMSL_API extern "C" __attribute__((visibility("default")))

// The version of the package this library was built for (pyproject.toml's), such as "0.1.0":
// the Python package refuses a library of another version (TMSL_LIBRARY naming another build).
TMSL_API const char* tmsl_version(void);
// "ok,invalid_argument,...": the status codes' names, code 0 first.
TMSL_API const char* tmsl_status_names(void);
TMSL_API int tmsl_last_error_code(void);
TMSL_API const char* tmsl_last_error_message(void);
TMSL_API void tmsl_last_error_oom(const char** tag, size_t* bytes_needed, size_t* bytes_free,
                                  int* device);
// 1 when an allocation hook failed on this thread since the last call (its error is then
// the thread's last error), else 0. Clears the mark.
TMSL_API int tmsl_take_allocation_failure(void);
// An error in a child forked from a process that has used the library (the savers, their
// threads and their device memory belong to the parent), else 0.
TMSL_API int tmsl_check_process(void);

// The process-wide (CUDA) saver, created on first call.
TMSL_API int tmsl_default_saver(void** out);
// The process-wide saver if a region or the allocation hooks created it already, else NULL:
// for reads, which must not start the CUDA driver.
TMSL_API int tmsl_existing_default_saver(void** out);

// The node's host-memory budget (node_ledger.h): every process of the node that uses the
// library takes the host memory of its backups and host cache from it. `active` 0: no
// ledger could be opened, no budget applies, and `error` says why. `holders` lists up to
// TMSL_MAX_HOLDERS processes holding some (`holder_count` may be larger), each by its entry
// in the ledger (unique while it lives; pids of processes of other pid namespaces repeat) and
// its pid as it saw itself; `holder_this_process` 1 for this process's.
#define TMSL_MAX_HOLDERS 64
typedef struct TmslHostMemory {
  int active;
  uint64_t budget_bytes, held_by_this_process, held_by_others;
  uint64_t holder_count;
  int64_t holder_pid[TMSL_MAX_HOLDERS];
  uint64_t holder_bytes[TMSL_MAX_HOLDERS], holder_cached_bytes[TMSL_MAX_HOLDERS];
  char path[4096];
  char error[1024];
  uint64_t shared_bytes;  // the node's shared backups (TMSL_SHARE_BACKUPS), counted once
  uint64_t holder_entry[TMSL_MAX_HOLDERS];
  int32_t holder_this_process[TMSL_MAX_HOLDERS];
  // Bytes of the node's shared backups each holder maps (its copies held once by the node).
  uint64_t holder_shared_bytes[TMSL_MAX_HOLDERS];
  // 1 where this process's large backups go into the node's store; else `sharing_off` says
  // why (the store's decision, or what the latest backup offered to it met).
  int32_t backups_shared;
  char sharing_off[1024];
  char store[4096];  // the node's store's directory, beside the ledger ("<ledger>.store")
  // 1 where sharing is on but this process is alone on the node (no other live process uses
  // the library), so that its backups are private copies until one does.
  int32_t alone;
} TmslHostMemory;
TMSL_API int tmsl_host_memory(TmslHostMemory* out);

// enable_cpu_backup, the region's backup choice: -1 = not given (the tag's first explicit
// setting; without one, graph memory only), 0 = off, 1 = on, 2 = on with the host memory
// given back at every resume (cpu_backup_backend "mmap"), 3 = disk (no host copy; the
// Python side writes the content to a file). Each allocation keeps its region's choice.

// Checks that `tag` may take allocations (not paused), enters it in the saver's tag
// catalogue, and makes it the calling thread's region.
TMSL_API int tmsl_enter_region(void* saver, const char* tag, int enable_cpu_backup);
// Makes (saver, tag) the thread's region again without checks (leaving a nested region).
// saver == NULL: the thread leaves its region and follows the process defaults again
// (no region, unless TMSL_REGION_ALL_THREADS=1).
TMSL_API int tmsl_set_thread_region(void* saver, const char* tag, int enable_cpu_backup);
// The thread allocates outside any region, whatever the defaults say (saver.disable()).
TMSL_API int tmsl_disable_thread_region(void);
// A CUDA graph capture is beginning on the calling thread: the tag of the thread's region
// (if any) holds graph memory from now on. No region: nothing to do.
TMSL_API int tmsl_note_graph_capture(void);

// ntags < 0: every tag. A named tag no region has used is an error. *store_notices (where
// given, also on failure): how many refusals of the node's store wait to be told
// (tmsl_store_notices), so the caller asks only then.
TMSL_API int tmsl_pause(void* saver, const char* const* tags, int ntags, size_t* store_notices);
// *stray_tags (where given): how many tags the resume covered are awake with stray writes to
// tell (tmsl_take_stray_writes), so the caller asks only then; *store_notices as tmsl_pause's.
TMSL_API int tmsl_resume(void* saver, const char* const* tags, int ntags, size_t* stray_tags, size_t* store_notices);
// Sets host memory aside, in the background, for the backups the next pause of the tags
// (ntags < 0: all) will take, within the host cache's budget (Saver::prepare_backups).
// Best effort, and returns at once; tags no region has used are skipped.
TMSL_API int tmsl_prepare_backups(void* saver, const char* const* tags, int ntags);
// Paused memory whose content the node's host-memory budget sent to disk (Saver::spilled_bytes).
TMSL_API int tmsl_spilled_bytes(void* saver, size_t* bytes);
// The disk tier's directory is the option disk_backup_dir (tmsl_set_option, below;
// Saver::set_disk_directory): checked, made if missing, its stale files removed; "": none.
// Once set, pauses write disk-backed allocations (and what the node's budget cannot hold) to
// files themselves, and resumes read them back.
// tmsl_disk_notices: what the tier has to tell since last asked (stale files removed,
// O_DIRECT refused), one line each, NUL-terminated, cut to `capacity` bytes.
// tmsl_check_disk_backup_dir: the directory checks alone, with
// no saver (refused on host memory or unwritable; make != 0: made if missing, its stale files
// removed, *real its real path, `notices` what to tell as tmsl_disk_notices; make == 0:
// nothing changed, *real the path as given, `notices` "").
TMSL_API int tmsl_check_disk_backup_dir(const char* path, int make, char* real, size_t capacity, char* notices,
                                        size_t notices_capacity);
TMSL_API int tmsl_disk_notices(void* saver, char* out, size_t capacity);
// What the node's store of shared backups refused since last asked, in this process (a key or
// directory others may read or write, a chunk not this user's alone, made in another PID
// namespace, or cut short: NodeStore::take_notices), one line each, each told once, as
// tmsl_disk_notices.
TMSL_API int tmsl_store_notices(char* out, size_t capacity);
// *state: 0 = no region has used the tag, 1 = active, 2 = paused.
TMSL_API int tmsl_tag_state(void* saver, const char* tag, int* state);
// The stray writes seen in the tag's memory since last asked, while it is awake (0 while it
// is paused: they are told once it resumes), and the mode (0, 1, 2) it follows.
TMSL_API int tmsl_take_stray_writes(void* saver, const char* tag, uint64_t* count, int* mode);
// The device memory the saver's stray-access scratch holds on `device` (0: none made).
TMSL_API int tmsl_stray_scratch_bytes(void* saver, int device, uint64_t* out);
// The tag's allocations in address order, each with its region's backup choice (as above):
// *count of them, the first `capacity` written.
TMSL_API int tmsl_tag_allocations(void* saver, const char* tag, uint64_t* addresses, uint64_t* sizes,
                                  int* devices, int* choices, size_t capacity, size_t* count);

// The options (platform/options.h: one table of every switch a program may set), by name, with
// values as text in the grammar of their kind (flag 0/1/false/true, size in bytes with an
// optional K/M/G/T, stray off/warn/raise, path). saver NULL: the process's value, which is
// what a new saver starts with (the environment's, else the table's default), a tag's
// default, or the node's (host_memory_budget, the only one set with saver NULL: for every
// process of the node). tag NULL: the saver's value; a tag: that tag's own (options of the tag
// scope, from its next pause on; the value "" takes the tag's own back, so that it follows the
// saver's value again (stray_access, soft_pause) or the default (verify_wake, caches_backups),
// and reads back as "" where the tag has none). Setting a tag enters it.
// tmsl_get_option writes the value and its NUL into out (kInvalidArgument where capacity is
// too small). tmsl_options: the table, one line per option, "name, kind, scopes, variable,
// torch_memory_saver's variable, default, default under TMSL_LIKE_TORCH_MEMORY_SAVER"
// separated by tabs; *length its length; the first capacity - 1 bytes and a NUL into out.
TMSL_API int tmsl_set_option(void* saver, const char* tag, const char* name, const char* value);
TMSL_API int tmsl_get_option(void* saver, const char* tag, const char* name, char* out, size_t capacity);
TMSL_API int tmsl_options(char* out, size_t capacity, size_t* length);
// Frees the host memory the host cache keeps for resident allocations.
TMSL_API int tmsl_release_host_cache(void* saver);
// Returns once the background work handed over has run: backups a resume let go of freed,
// host memory asked for by tmsl_prepare_backups set aside (its pages may still be arriving).
TMSL_API int tmsl_wait_for_released_backups(void* saver);

// What each tag holds, per device: one entry per (tag, device) with allocations, and one
// with device -1 for a tag that has none; in tag order. *count is the number of entries;
// the first `capacity` are written, so a caller can retry with a larger array.
#define TMSL_MAX_TAG_BYTES 1024
typedef struct TmslTagFigures {
  char tag[TMSL_MAX_TAG_BYTES + 1];  // NUL-terminated
  int device;
  int paused;        // the tag is paused (and not resumed since)
  int graph_memory;  // a CUDA graph was captured into it
  int backs_up;      // a pause copies some of it to host memory
  uint64_t allocations, reserved_bytes, resident_bytes, paused_bytes, host_backup_bytes;
  double last_pause_seconds, last_resume_seconds;  // negative: never
  uint64_t disk_backup_bytes;  // paused bytes whose content is in disk files
  int last_wake_check;  // 0 never, 1 passed, 2 failed, 3 unchecked (WakeCheck, saver.h)
  // Where the content of its paused allocations is, by their bytes (together: paused_bytes).
  uint64_t paused_in_host, paused_in_store, paused_on_disk, paused_discarded;
  uint64_t stray_writes;  // checks that found writes in its paused memory without a backup here
} TmslTagFigures;
TMSL_API int tmsl_tag_figures(void* saver, TmslTagFigures* out, size_t capacity, size_t* count);
// 0 when `tag` ([tag, tag + length)) is a valid tag name: 1 to 256 characters of UTF-8
// without NUL, the rule every entry point that takes a tag applies; else the error says why.
TMSL_API int tmsl_check_tag(const char* tag, size_t length);
// For [ptr, ptr + nbytes) of a backed-up allocation: *host points at its host copy while
// paused (NULL while resident), and *lease keeps that memory alive, also past the next
// resume or free, until tmsl_release_lease(*lease).
TMSL_API int tmsl_lease_backup(void* saver, const void* ptr, size_t nbytes, const void** host, void** lease);
TMSL_API int tmsl_release_lease(void* lease);
// *paused = 1 when [ptr, ptr + nbytes) overlaps memory of the saver that is not active (paused,
// or being paused or resumed), with its tag NUL-terminated in tag[0 .. capacity); else 0.
TMSL_API int tmsl_paused_tag_in(void* saver, const void* ptr, size_t nbytes, int* paused, char* tag,
                                size_t capacity);

// "" when the TMSL_* environment variables are valid, else what is wrong with them.
TMSL_API const char* tmsl_process_defaults_error(void);
// The process defaults the library read from the environment (environment.h lists the
// variables and their grammar), the one reader for both languages; what is wrong with them is
// in tmsl_process_defaults_error().
typedef struct TmslProcessDefaults {
  int region_all_threads;  // TMSL_REGION_ALL_THREADS / TMS_INIT_ENABLE
  int backup_choice;       // the default region's enable_cpu_backup choice (-1 to 3, as above)
  int caches_backups;      // 0: TMSL_DEFAULT_CPU_BACKUP_BACKEND / TMS_INIT_CPU_BACKUP_BACKEND=mmap
  char tag[TMSL_MAX_TAG_BYTES + 1];      // TMSL_DEFAULT_TAG ("default")
  char disk_backup_dir_variable[32];     // which variable named the directory ("": none)
  char disk_backup_dir[4096];            // TMSL_DISK_BACKUP_DIR / TMS_DISK_BACKUP_DIR
  int share_backups;                     // TMSL_SHARE_BACKUPS
  int like_torch_memory_saver;           // TMSL_LIKE_TORCH_MEMORY_SAVER
} TmslProcessDefaults;
TMSL_API int tmsl_process_defaults(TmslProcessDefaults* out);
// The disk backup's chunk (TMSL_DISK_BACKUP_CHUNK_MB / TMS_DISK_BACKUP_CHUNK_MB, in bytes) and
// requests in flight (TMSL_DISK_BACKUP_WORKERS), read from the environment at this call;
// invalid_argument names a bad or disagreeing variable.
TMSL_API int tmsl_disk_backup_settings(uint64_t* chunk_bytes, uint64_t* workers);
// 1 when this library's cudaMalloc is the one the process calls (LD_PRELOAD in effect).
TMSL_API int tmsl_preload_active(void);

// What the CUDA driver reports, asked as the CUDA backend asks (libcuda.so.1 or
// $TMSL_CUDA_DRIVER_LIBRARY, through cuGetProcAddress) and without creating a context, as
// JSON: {"requested", "loaded", "path" (the file loaded),
// "error" ("" when every query succeeded), "version" (cuDriverGetVersion), "devices": [{"index",
// "name", "total_bytes", "vmm" (virtual memory management supported), "granularity" (bytes),
// "error"}]}; null where not known. A missing driver is reported there, not as a failure.
TMSL_API int tmsl_driver_info_json(char* buf, size_t capacity, size_t* length);

// The devices (indices, ascending) on which this process holds a primary CUDA context, asked
// of the driver without making one: *count is how many there are, of which the first
// `capacity` are written to `devices`. None before any context exists. kNoDriver without a
// usable driver.
TMSL_API int tmsl_devices_with_context(int* devices, size_t capacity, size_t* count);

// torch_memory_saver's C entry points under its names (tms_compat.cpp), for code that binds
// them with ctypes. They act on the process-wide saver and the calling thread's region
// (its "configuration"). tms_pause/tms_resume: tag NULL = every tag, a tag no region has used
// is skipped; they return a status code. The getters and setters read and change the
// thread's region: whether it is one ("interesting"), its tag, and its backup choice.
TMSL_API int tms_pause(const char* tag);
TMSL_API int tms_resume(const char* tag);
TMSL_API const char* tms_get_current_tag(void);
TMSL_API void tms_set_current_tag(const char* tag);
TMSL_API bool tms_get_interesting_region(void);
TMSL_API void tms_set_interesting_region(bool interesting);
TMSL_API bool tms_get_enable_cpu_backup(void);
TMSL_API void tms_set_enable_cpu_backup(bool enable);
TMSL_API const char* tms_get_cpu_backup_backend(void);  // "pinned" or "mmap"
TMSL_API void tms_set_cpu_backup_backend(const char* backend);
TMSL_API bool tms_get_enable_disk_backup(void);
TMSL_API void tms_set_enable_disk_backup(bool enable);
TMSL_API void set_memory_margin_bytes(uint64_t bytes);
TMSL_API void tms_set_retain_cpu_backup(bool retain);
TMSL_API bool tms_get_retain_cpu_backup(void);

// torch hook mode (hook_torch.cpp): a CUDAPluggableAllocator's malloc and free. Allocations
// go to the calling thread's region; a failure returns NULL and is kept as above.
TMSL_API void* tmsl_torch_malloc(ssize_t size, int device, void* stream);
TMSL_API void tmsl_torch_free(void* ptr, size_t size, int device, void* stream);

// preload hook mode (hook_preload.cpp): in front of the CUDA runtime's functions under
// LD_PRELOAD. They return cudaError_t values.
TMSL_API int cudaMalloc(void** ptr, size_t size);
TMSL_API int cudaFree(void* ptr);
