// preload hook mode: this library's cudaMalloc/cudaFree, in front of the CUDA runtime's
// under LD_PRELOAD. An allocation on a thread inside a region goes to the saver; every
// other call goes straight to the runtime's function (found with dlsym(RTLD_NEXT)). The
// path for foreign pointers takes no global lock and never synchronizes: a thread-local
// read for cudaMalloc, a sharded address lookup for cudaFree.
#include <dlfcn.h>

#include <cstdio>

#include "api/abi_guard.h"
#include "api/node_budget.h"
#include "api/c_api.h"
#include "core/thread_region.h"

using namespace tmsl;

namespace {

// cudaError_t values (driver_types.h), without pulling in the runtime's headers.
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorInvalidValue = 1;
constexpr int kCudaErrorMemoryAllocation = 2;
constexpr int kCudaErrorInitializationError = 3;
constexpr int kCudaErrorUnknown = 999;

using MallocFn = int (*)(void**, size_t);
using FreeFn = int (*)(void*);
using GetDeviceFn = int (*)(int*);

// The runtime's own function: the next definition after this library, or, where the
// runtime was loaded privately (RTLD_LOCAL), the one in an already loaded libcudart.
void* runtime_symbol(const char* name) {
  void* fn = dlsym(RTLD_NEXT, name);
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    if (fn != nullptr) break;
    if (void* handle = dlopen(lib, RTLD_NOW | RTLD_NOLOAD)) fn = dlsym(handle, name);
  }
  return fn;
}

MallocFn runtime_malloc() {
  static MallocFn fn = reinterpret_cast<MallocFn>(runtime_symbol("cudaMalloc"));
  return fn;
}
FreeFn runtime_free() {
  static FreeFn fn = reinterpret_cast<FreeFn>(runtime_symbol("cudaFree"));
  return fn;
}
GetDeviceFn runtime_get_device() {
  static GetDeviceFn fn = reinterpret_cast<GetDeviceFn>(runtime_symbol("cudaGetDevice"));
  return fn;
}

// A bad TMSL_* variable is never fatal: say so once, then run without default regions.
void warn_about_defaults_once() {
  static bool warned = [] {
    const std::string& error = process_defaults().error;
    if (!error.empty()) fprintf(stderr, "torch_mem_saver_lite: %s; regions stay off\n", error.c_str());
    return true;
  }();
  (void)warned;
}

}  // namespace

TMSL_API int cudaMalloc(void** ptr, size_t size) {
  warn_about_defaults_once();
  const ThreadRegion& region = effective_region(&saver_setup, process_defaults());
  if (size == 0 || region.saver == 0) {
    MallocFn real = runtime_malloc();
    return real != nullptr ? real(ptr, size) : kCudaErrorInitializationError;
  }
  int result = kCudaErrorUnknown;
  guarded([&] {
    if (ptr == nullptr) {
      result = kCudaErrorInvalidValue;
      return Status::Error(Code::kInvalidArgument, "cudaMalloc: the result pointer must not be NULL");
    }
    SaverRef saver;
    Status s = region_saver(region, &saver);
    int device = 0;
    GetDeviceFn get_device = runtime_get_device();
    if (s.ok() && saver->backend().follows_current_device() && get_device != nullptr &&
        get_device(&device) != kCudaSuccess) {
      result = kCudaErrorInitializationError;
      return Status::Error(Code::kDriverError, "cudaMalloc: cudaGetDevice failed");
    }
    uintptr_t va = 0;
    if (s.ok()) s = saver->allocate(size, device, region.tag, region.backup, &va);
    if (!s.ok()) {
      note_allocation_failure(s);
      result = s.code == Code::kOutOfMemory ? kCudaErrorMemoryAllocation : kCudaErrorUnknown;
      return s;
    }
    *ptr = reinterpret_cast<void*>(va);
    result = kCudaSuccess;
    return s;
  });
  return result;
}

TMSL_API int cudaFree(void* ptr) {
  // In a child forked from a process with savers, CUDA is unusable and the memory is the
  // parent's: freeing is a no-op, so the child's exit (torch frees its pools) is clean.
  if (in_forked_child()) return kCudaSuccess;
  if (ptr != nullptr) {
    if (SaverRef saver = owner_of(reinterpret_cast<uintptr_t>(ptr))) {
      // nullptr: the legacy default stream, which cudaFree's callers expect to be waited for.
      int status = guarded([&] { return saver->free(reinterpret_cast<uintptr_t>(ptr), nullptr); });
      return status == 0 ? kCudaSuccess : kCudaErrorUnknown;
    }
  }
  FreeFn real = runtime_free();
  return real != nullptr ? real(ptr) : kCudaErrorInitializationError;
}

namespace {
void this_library() {}
}  // namespace

// Asks the global scope (the main program's handle: RTLD_DEFAULT would also search this
// library's own scope when it was loaded locally) and compares shared objects, not
// addresses: inside this library `&cudaMalloc` may be bound to the runtime's definition.
TMSL_API int tmsl_preload_active(void) {
  void* global_scope = dlopen(nullptr, RTLD_NOW);
  void* first = global_scope != nullptr ? dlsym(global_scope, "cudaMalloc") : nullptr;
  Dl_info found, mine;
  if (first == nullptr || dladdr(first, &found) == 0 ||
      dladdr(reinterpret_cast<void*>(&this_library), &mine) == 0) {
    return 0;
  }
  return found.dli_fbase == mine.dli_fbase ? 1 : 0;
}
