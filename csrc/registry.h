// The process's savers and each thread's current region.
//
// The process-wide saver (CUDA backend) is what the allocation hooks serve; further
// savers (host backend) exist for tests. Savers live on the heap and the process-wide one
// is never destroyed, so frees that arrive during interpreter or process teardown still
// find it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "saver.h"

namespace tmsl {

// Where the allocation hooks send this thread's allocations; saver == nullptr means
// "not in a region": the hooks leave the allocation alone.
struct ThreadRegion {
  Saver* saver = nullptr;
  std::string tag;
  bool backup = false;
};
ThreadRegion& thread_region();

// Creates the CUDA-backed saver on first call; fails (and retries next time) without a driver.
Status default_saver(Saver** out);
Saver* add_saver(std::unique_ptr<Saver> saver);
// Destroys a saver made by add_saver; the process-wide one cannot be removed.
Status remove_saver(Saver* saver);
bool is_live(const Saver* saver);
// The saver holding an allocation that starts at va, or nullptr.
Saver* owner_of(uintptr_t va);

}  // namespace tmsl
