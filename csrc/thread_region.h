// Each thread's current region, and the process defaults that stand in for it.
//
// The allocation hooks read the calling thread's region on every allocation: which saver
// (by handle, so a region of a closed saver resolves to nothing), which tag, and the
// backup choice it was entered with.
#pragma once

#include <string>

#include "registry.h"

namespace tmsl {

// Where the allocation hooks send this thread's allocations. A thread that never set a
// region follows the process defaults (environment variables, see ProcessDefaults);
// `explicit_none` is a region turned off on purpose (saver.disable()).
struct ThreadRegion {
  SaverHandle saver = 0;
  std::string tag;
  BackupChoice backup = BackupChoice::kAuto;
  bool explicit_none = false;
};
ThreadRegion& thread_region();

// The region an allocation on this thread belongs to right now, defaults applied;
// saver == 0: none, the hooks leave the allocation to the ordinary allocator.
// A reference, not a copy: the hooked malloc path reads it on every call.
const ThreadRegion& effective_region();

// The live saver of a region; kInvalidArgument when its saver has been closed since.
Status region_saver(const ThreadRegion& region, SaverRef* out);

// Process defaults from the environment, read once:
//   TMSL_REGION_ALL_THREADS=1   every thread allocates in a region unless told otherwise
//                               (torch_memory_saver's name: TMS_INIT_ENABLE)
//   TMSL_DEFAULT_TAG=<tag>      that region's tag (default "default")
//   TMSL_DEFAULT_CPU_BACKUP=0|1 and its backup setting (unset: back up graph memory only;
//                               torch_memory_saver's name: TMS_INIT_ENABLE_CPU_BACKUP)
//   TMSL_DEFAULT_DISK_BACKUP=0|1 that region's content goes to disk at a pause instead (kDisk;
//                               torch_memory_saver's name: TMS_INIT_ENABLE_DISK_BACKUP)
//   TMSL_DEFAULT_CPU_BACKUP_BACKEND=pinned|mmap  the backend of backed-up regions that name
//                               none (torch_memory_saver's name: TMS_INIT_CPU_BACKUP_BACKEND);
//                               with mmap the default region's choice is kOnUncached
//   TMSL_POISON_ON_RESUME=1     savers start with poison on resume turned on
//   TMSL_RETAIN_CPU_BACKUP=1    keep host backups after a resume (torch_memory_saver's name:
//                               TMS_RETAIN_CPU_BACKUP)
//   TMSL_DISK_BACKUP_DIR=path   where disk backups go (torch_memory_saver's name:
//                               TMS_DISK_BACKUP_DIR); checked where it is used
// The one reader of these variables for both languages (Python reads the result through
// tmsl_process_defaults). A bad value leaves regions off and is kept in `error`, naming
// the variable.
constexpr size_t kMaxDiskBackupDirBytes = 4096;  // with its NUL: what TmslProcessDefaults holds

struct ProcessDefaults {
  bool all_threads = false;
  std::string tag = "default";
  BackupChoice backup = BackupChoice::kAuto;
  bool caches_backups = true;  // the default backend is "pinned"
  bool poison_on_resume = false;
  bool retain_backups = false;
  std::string disk_backup_dir_variable;  // the variable that named it ("": none did)
  std::string disk_backup_dir;
  std::string error;
};
const ProcessDefaults& process_defaults();

}  // namespace tmsl
