// Each thread's current region, and the process defaults that stand in for it (handed down by
// the api layer, which alone reads them).
//
// The allocation hooks read the calling thread's region on every allocation: which saver
// (by handle, so a region of a closed saver resolves to nothing), which tag, and the
// backup choice it was entered with.
#pragma once

#include <string>

#include "platform/environment.h"
#include "core/registry.h"

namespace tmsl {

// Where the allocation hooks send this thread's allocations. A thread that never set a
// region follows the process defaults (environment variables, see environment.h);
// `explicit_none` is a region turned off on purpose (saver.disable()).
struct ThreadRegion {
  SaverHandle saver = 0;
  std::string tag;
  BackupChoice backup = BackupChoice::kAuto;
  bool explicit_none = false;
};
ThreadRegion& thread_region();

// The region an allocation on this thread belongs to right now, `defaults` (the process's,
// which the api layer reads) applied; saver == 0: none, the hooks leave the allocation to the
// ordinary allocator. A reference, not a copy: the hooked malloc path reads it on every call.
// `setup`: for the process-wide saver, should this call make it.
const ThreadRegion& effective_region(SetupSource setup, const ProcessDefaults& defaults);

// The live saver of a region; kInvalidArgument when its saver has been closed since.
Status region_saver(const ThreadRegion& region, SaverRef* out);

}  // namespace tmsl
