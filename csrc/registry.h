// The process's savers and each thread's current region.
//
// The process-wide saver (CUDA backend) is what the allocation hooks serve; further
// savers (host backend) exist for tests. Savers live on the heap and the process-wide one
// is never destroyed, so frees that arrive during interpreter or process teardown still
// find it. Lookups from the hooks (owner_of) read a fixed array of atomics: no lock.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "saver.h"

namespace tmsl {

// Where the allocation hooks send this thread's allocations. A thread that never set a
// region follows the process defaults (environment variables, see preload_defaults);
// `explicit_none` is a region turned off on purpose (saver.disable()).
struct ThreadRegion {
  Saver* saver = nullptr;
  std::string tag;
  BackupChoice backup = BackupChoice::kAuto;
  bool explicit_none = false;
};
ThreadRegion& thread_region();

// The region an allocation on this thread belongs to right now, defaults applied;
// saver == nullptr: none, the hooks leave the allocation to the ordinary allocator.
// A reference, not a copy: the hooked malloc path reads it on every call.
const ThreadRegion& effective_region();

// Process defaults from the environment, read once:
//   TMSL_REGION_ALL_THREADS=1   every thread allocates in a region unless told otherwise
//   TMSL_DEFAULT_TAG=<tag>      that region's tag (default "default")
//   TMSL_DEFAULT_CPU_BACKUP=0|1 and its backup setting (unset: back up graph memory only)
//   TMSL_POISON_ON_RESUME=1     savers start with poison on resume turned on
// A bad value leaves regions off and is kept in `error`, naming the variable.
struct ProcessDefaults {
  bool all_threads = false;
  std::string tag = "default";
  BackupChoice backup = BackupChoice::kAuto;
  bool poison_on_resume = false;
  std::string error;
};
const ProcessDefaults& process_defaults();

// Creates the CUDA-backed saver on first call; fails (and retries next time) without a driver.
Status default_saver(Saver** out);
Status add_saver(std::unique_ptr<Saver> saver, Saver** out);
// Destroys a saver made by add_saver; the process-wide one cannot be removed. Must not
// race with frees of its memory.
Status remove_saver(Saver* saver);
bool is_live(const Saver* saver);
// The saver holding an allocation that starts at va, or nullptr.
Saver* owner_of(uintptr_t va);

}  // namespace tmsl
