// torch hook mode: the two functions a torch.cuda.memory.CUDAPluggableAllocator calls.
// Python creates one torch.cuda.MemPool per (tag, device, backup choice) on top of them and
// routes a region's allocations into it; the tag comes from the calling thread's region.
#include "api/abi_guard.h"
#include "api/node_budget.h"
#include "api/c_api.h"
#include "core/thread_region.h"

using namespace tmsl;

TMSL_API void* tmsl_torch_malloc(ssize_t size, int device, void* /*stream*/) {
  void* out = nullptr;
  guarded([&] {
    Status s = size > 0 ? Status::Ok()
                        : Status::Error(Code::kInvalidArgument,
                                        "torch asked for " + std::to_string(size) + " bytes; sizes must be > 0");
    const ThreadRegion& region = effective_region(&saver_setup, process_defaults());
    if (s.ok() && region.saver == 0) {
      s = Status::Error(Code::kInvalidArgument,
                        "an allocation reached a torch_mem_saver_lite pool outside saver.region(): "
                        "allocate into saver pools only through saver.region()");
    }
    SaverRef saver;
    if (s.ok()) s = region_saver(region, &saver);
    uintptr_t va = 0;
    if (s.ok()) s = saver->allocate(static_cast<size_t>(size), device, region.tag, region.backup, &va);
    if (s.ok()) {
      out = reinterpret_cast<void*>(va);
    } else {
      note_allocation_failure(s);
    }
    return s;
  });
  return out;
}

// torch has no way to hear of a failure here; it stays the thread's last error.
TMSL_API void tmsl_torch_free(void* ptr, size_t /*size*/, int /*device*/, void* stream) {
  if (ptr == nullptr) return;
  guarded([&] {
    SaverRef saver = owner_of(reinterpret_cast<uintptr_t>(ptr));
    return saver ? saver->free(reinterpret_cast<uintptr_t>(ptr), stream)
                            : Status::Error(Code::kInvalidArgument,
                                            "torch freed a pointer torch_mem_saver_lite does not hold");
  });
}
