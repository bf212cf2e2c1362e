// torch hook mode: the two functions a torch.cuda.memory.CUDAPluggableAllocator calls.
// Python creates one torch.cuda.MemPool per (tag, device) on top of them and routes a
// region's allocations into it; the tag comes from the calling thread's region.
#include <sys/types.h>

#include "c_api.h"
#include "registry.h"

using namespace tmsl;

TMSL_API void* tmsl_torch_malloc(ssize_t size, int device, void* /*stream*/) {
  if (size <= 0) return nullptr;
  const ThreadRegion& region = effective_region();
  if (region.saver == nullptr) {
    set_last_error(Status::Error(
        Code::kInvalidArgument,
        "an allocation reached a torch_mem_saver_lite pool outside saver.region(): allocate "
        "into saver pools only through saver.region()"));
    return nullptr;
  }
  uintptr_t va = 0;
  Status s = region.saver->allocate(static_cast<size_t>(size), device, region.tag, region.backup, &va);
  if (!s.ok()) {
    set_last_error(s);
    return nullptr;
  }
  return reinterpret_cast<void*>(va);
}

// torch has no way to hear of a failure here; it stays the thread's last error.
TMSL_API void tmsl_torch_free(void* ptr, size_t /*size*/, int /*device*/, void* stream) {
  if (ptr == nullptr) return;
  Saver* saver = owner_of(reinterpret_cast<uintptr_t>(ptr));
  Status s = saver != nullptr
                 ? saver->free(reinterpret_cast<uintptr_t>(ptr), stream)
                 : Status::Error(Code::kInvalidArgument,
                                 "torch freed a pointer torch_mem_saver_lite does not hold");
  if (!s.ok()) set_last_error(s);
}
