// The library's one reader of the TMSL_*/TMS_* variables, for both languages: Python reads what
// it read through tmsl_process_defaults and tmsl_disk_backup_settings. (Python reads two itself,
// before or without the library: TMSL_LIBRARY, the library _lib.py loads, and
// TMSL_ALIAS_TORCH_MEMORY_SAVER, alias_hook.py's switch.)
//
// One grammar per kind:
//   flag         0, 1, false or true, in any case
//   whole number ASCII digits within the setting's range
//   size         a whole number of bytes above 0, optionally followed by K, M, G or T
//                (powers of 1024, in any case): 65536, 512M, 64G
//   choice       one of the setting's names, in any case
// Surrounding spaces are ignored and an empty value counts as unset. A setting that also has
// a torch_memory_saver name (TMS_*) is read from whichever is set; both set to different
// values is an error. A bad value is never fatal: it is kept as an error naming the
// variable, the value and what it takes, which Python raises at first use.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "platform/backup_choice.h"
#include "platform/options.h"
#include "platform/status.h"

namespace tmsl {

// The grammar itself: parse_flag, parse_whole_number, parse_size (options.h).

constexpr size_t kMaxDiskBackupDirBytes = 4096;  // with its NUL: what TmslProcessDefaults holds

// Read once, at first use:
//   TMSL_LIKE_TORCH_MEMORY_SAVER (flag)   defaults as torch_memory_saver has them, for the five
//                               behaviours it has no counterpart for: no host cache kept after
//                               a resume (keeps_host_cache), no host-memory budget, no shared
//                               backups, no wake check, stray access off. Only defaults: each
//                               setting's own variable (and what a program sets) still wins.
//   TMSL_REGION_ALL_THREADS / TMS_INIT_ENABLE (flag)   every thread allocates in a region
//                               unless told otherwise
//   TMSL_DEFAULT_TAG=<tag>      that region's tag (default "default")
//   TMSL_DEFAULT_CPU_BACKUP / TMS_INIT_ENABLE_CPU_BACKUP (flag)   its backup setting (unset:
//                               back up graph memory only)
//   TMSL_DEFAULT_DISK_BACKUP / TMS_INIT_ENABLE_DISK_BACKUP (flag)   its content goes to disk
//                               at a pause instead (kDisk)
//   TMSL_DEFAULT_CPU_BACKUP_BACKEND / TMS_INIT_CPU_BACKUP_BACKEND (pinned|mmap)   the backend
//                               of backed-up regions that name none; with mmap the default
//                               region's choice is kOnUncached
//   the options table's variables (options.h: its rows name them, with each one's kind and
//                               default): what a saver starts with, and TMSL_HOST_MEMORY_BUDGET,
//                               the node's budget, set when the ledger opens
//   TMSL_SHARE_BACKUPS (flag)   identical large backups are stored once per node: unset, where
//                               another process of the node uses the library; 1 also alone; 0 never
//   TMSL_HOST_LEDGER (path)     the ledger file the node's processes share ("": the default)
//   TMSL_LOG_ALLOCATIONS (flag)   savers print a line per allocation and free to stderr
// A bad value leaves the default regions off and is kept in `error`.
struct ProcessDefaults {
  bool like_torch_memory_saver = false;
  bool keeps_host_cache = true;  // false: savers start with a host cache of 0 bytes
  bool all_threads = false;
  std::string tag = "default";
  BackupChoice backup = BackupChoice::kAuto;
  bool caches_backups = true;  // the default backend is "pinned"
  // The process defaults of the options a saver holds itself (options.h's saver_holds), by
  // Option, from their variables; the others' slots unused.
  std::array<uint64_t, kOptionCount> saver_options{};
  std::string disk_backup_dir_variable;  // the variable that named it ("": none did)
  std::string disk_backup_dir;
  bool share_backups = true;
  bool share_backups_given = false;  // TMSL_SHARE_BACKUPS set (else the default or the switch's)
  size_t host_memory_budget = 0;  // 0: not set
  bool host_memory_budget_applies = true;  // false: this process's backups take no budget
  std::string host_memory_budget_error;  // what is wrong with it ("": nothing); also in `error`
  std::string host_ledger;  // "": the default file (node_ledger.cpp)
  bool log_allocations = false;
  std::string error;
};
const ProcessDefaults& process_defaults();

// Read at each call (each disk-backed pause): TMSL_DISK_BACKUP_CHUNK_MB /
// TMS_DISK_BACKUP_CHUNK_MB (whole number of MiB, 1 to 4096, default 64) and
// TMSL_DISK_BACKUP_WORKERS (whole number, 1 to 64, default 4). kInvalidArgument names a bad one.
constexpr size_t kDefaultDiskChunkMiB = 64, kMaxDiskChunkMiB = 4096;
constexpr size_t kDefaultDiskWorkers = 4, kMaxDiskWorkers = 64;
Status disk_backup_settings(size_t* chunk_bytes, size_t* workers);

// The CUDA driver library to open: TMSL_CUDA_DRIVER_LIBRARY, else libcuda.so.1 (read at each
// call; driver.h, the one loader, asks it each time it opens the driver).
std::string cuda_driver_library();

}  // namespace tmsl
