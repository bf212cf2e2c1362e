// The process's savers, found by handle.
//
// The process-wide saver (CUDA backend) is what the allocation hooks serve; further savers
// (host backend) exist for tests. A handle names a slot and the generation of the saver in
// it, so the handle of a destroyed saver never reaches a saver made later in the same slot
// (it resolves to nothing). The process-wide saver is never destroyed, so frees that arrive
// during interpreter or process teardown still find it. Lookups from the hooks (owner_of,
// find_saver) read a fixed array of atomics: no lock.
#pragma once

#include <cstdint>
#include <memory>

#include "saver.h"

namespace tmsl {

using SaverHandle = uint64_t;  // 0: no saver

// Creates the CUDA-backed saver on first call; fails (and retries next time) without a driver.
Status default_saver(SaverHandle* out);
Status add_saver(std::unique_ptr<Saver> saver, SaverHandle* out);
// Destroys a saver made by add_saver; the process-wide one cannot be removed. Must not
// race with calls on it or frees of its memory.
Status remove_saver(SaverHandle handle);
// The live saver a handle names, or nullptr (destroyed, or never made).
Saver* find_saver(SaverHandle handle);
// The saver holding an allocation that starts at va, or nullptr.
Saver* owner_of(uintptr_t va);

}  // namespace tmsl
