// A stand-in for libcuda.so.1, for tests on machines without a GPU: the CUDA backend
// (csrc/platform/backend_cuda.cpp) loads it when TMSL_CUDA_DRIVER_LIBRARY names it, and runs its real
// code over it. "Device memory" is host memory: a physical allocation is a memfd, mapping it
// maps the file at the reserved address, and unmapping puts an inaccessible reservation
// back, so a test can write and read it, see the pages go when it is released, and compare
// content bit for bit. Copies, fills and synchronisation happen at once.
//
// Environment, read at cuInit:
//   FAKE_CUDA_MEMORY_BYTES  device memory per device (default 1 GiB); cuMemCreate beyond it
//                           fails with CUDA_ERROR_OUT_OF_MEMORY, as on a full GPU
//   FAKE_CUDA_DEVICES       device count (default 1)
//   FAKE_CUDA_FAIL          "cuMemMap:3": that entry point's 3rd call (counted from
//                           cuInit) fails with CUDA_ERROR_UNKNOWN
//   FAKE_CUDA_NO_VMM_DEVICE that device ordinal reports no virtual memory management support
//
// Only what the backend (through cuGetProcAddress_v2) and torch_memory_saver (linked by
// name, for benchmarks/bench_core_overhead.py) call is here; signatures follow cuda.h at ABI
// version 12000, with its types spelled out so that no CUDA header is needed to build it.
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;

enum {
  kSuccess = 0,
  kInvalidValue = 1,
  kOutOfMemory = 2,
  kNotInitialized = 3,
  kInvalidDevice = 101,
  kNotFound = 500,
  kNotSupported = 801,
  kUnknown = 999,
};

#define GRANULARITY ((size_t)2 << 20)
#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8

static size_t g_memory_bytes = (size_t)1 << 30;
static int g_devices = 1;
static char g_fail_name[64];
static long g_fail_at;
static atomic_long g_fail_calls;
static atomic_int g_initialized;
static atomic_size_t g_used[MAX_DEVICES];
static char g_contexts[MAX_DEVICES];  // a context is the address of its device's byte
static char g_stream, g_event;
static int g_no_vmm_device = -1;

#define FAKE_DRIVER_VERSION 12080  // what cuDriverGetVersion reports: CUDA 12.8
#define ATTRIBUTE_VMM_SUPPORTED 102  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
#define LOCATION_HOST_NUMA 3  // CU_MEM_LOCATION_TYPE_HOST_NUMA

// Per thread: the context stack and the stream-capture mode.
static __thread CUcontext t_stack[16];
static __thread int t_depth;
static __thread int t_capture_mode;

struct Physical {
  int fd;
  size_t size;
  int device;
};

static int fails(const char* name) {
  if (g_fail_at <= 0 || strcmp(name, g_fail_name) != 0) return 0;
  return atomic_fetch_add(&g_fail_calls, 1) + 1 == g_fail_at;
}

EXPORT CUresult cuInit(unsigned flags) {
  (void)flags;
  const char* bytes = getenv("FAKE_CUDA_MEMORY_BYTES");
  const char* devices = getenv("FAKE_CUDA_DEVICES");
  const char* fail = getenv("FAKE_CUDA_FAIL");
  if (bytes != NULL && *bytes != '\0') g_memory_bytes = strtoull(bytes, NULL, 10);
  if (devices != NULL && *devices != '\0') g_devices = atoi(devices);
  if (g_devices < 1 || g_devices > MAX_DEVICES) g_devices = 1;
  if (fail != NULL && strchr(fail, ':') != NULL && strchr(fail, ':') - fail < (long)sizeof(g_fail_name)) {
    memcpy(g_fail_name, fail, (size_t)(strchr(fail, ':') - fail));
    g_fail_at = atol(strchr(fail, ':') + 1);
  }
  const char* no_vmm = getenv("FAKE_CUDA_NO_VMM_DEVICE");
  if (no_vmm != NULL && *no_vmm != '\0') g_no_vmm_device = atoi(no_vmm);
  atomic_store(&g_initialized, 1);
  return kSuccess;
}

EXPORT CUresult cuDriverGetVersion(int* version) {
  *version = FAKE_DRIVER_VERSION;
  return kSuccess;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char** out) {
  switch (error) {
    case kSuccess: *out = "CUDA_SUCCESS"; break;
    case kInvalidValue: *out = "CUDA_ERROR_INVALID_VALUE"; break;
    case kOutOfMemory: *out = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case kNotInitialized: *out = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case kInvalidDevice: *out = "CUDA_ERROR_INVALID_DEVICE"; break;
    case kNotFound: *out = "CUDA_ERROR_NOT_FOUND"; break;
    default: *out = "CUDA_ERROR_UNKNOWN"; return kInvalidValue;
  }
  return kSuccess;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char** out) {
  *out = error == kOutOfMemory ? "out of memory" : "fake driver error";
  return kSuccess;
}

EXPORT CUresult cuDeviceGetCount(int* count) {
  if (!atomic_load(&g_initialized)) return kNotInitialized;
  *count = g_devices;
  return kSuccess;
}

EXPORT CUresult cuDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= g_devices) return kInvalidDevice;
  *device = ordinal;
  return kSuccess;
}

EXPORT CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
  (void)attribute;
  if (device < 0 || device >= g_devices) return kInvalidDevice;
  *value = 1;  // virtual memory management, and anything else asked, is supported
  if (attribute == ATTRIBUTE_VMM_SUPPORTED && device == g_no_vmm_device) *value = 0;
  return kSuccess;
}

EXPORT CUresult cuDeviceGetName(char* name, int length, int device) {
  if (device < 0 || device >= g_devices) return kInvalidDevice;
  if (length > 0) snprintf(name, (size_t)length, "Fake CUDA device %d", device);
  return kSuccess;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, int device) {
  if (device < 0 || device >= g_devices) return kInvalidDevice;
  *bytes = g_memory_bytes;
  return kSuccess;
}

static atomic_int g_retained[MAX_DEVICES];  // primary contexts retained (made), per device

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, int device) {
  if (device < 0 || device >= g_devices) return kInvalidDevice;
  *context = &g_contexts[device];
  atomic_store(&g_retained[device], 1);
  return kSuccess;
}

EXPORT CUresult cuDevicePrimaryCtxGetState(int device, unsigned* flags, int* active) {
  if (device < 0 || device >= g_devices) return kInvalidDevice;
  *flags = 0;
  *active = atomic_load(&g_retained[device]);
  return kSuccess;
}

EXPORT CUresult cuCtxPushCurrent(CUcontext context) {
  if (t_depth == (int)(sizeof(t_stack) / sizeof(t_stack[0]))) return kUnknown;
  t_stack[t_depth++] = context;
  return kSuccess;
}

EXPORT CUresult cuCtxPopCurrent(CUcontext* context) {
  if (t_depth == 0) return kInvalidValue;
  CUcontext top = t_stack[--t_depth];
  if (context != NULL) *context = top;
  return kSuccess;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* context) {
  *context = t_depth > 0 ? t_stack[t_depth - 1] : NULL;
  return kSuccess;
}

EXPORT CUresult cuCtxSynchronize(void) { return kSuccess; }
EXPORT CUresult cuStreamSynchronize(CUstream stream) { (void)stream; return kSuccess; }

static int current_device(void) {
  return t_depth > 0 ? (int)((char*)t_stack[t_depth - 1] - g_contexts) : -1;
}

EXPORT CUresult cuCtxGetDevice(int* device) {
  *device = current_device();
  return *device < 0 ? kInvalidValue : kSuccess;
}

// The primary context of a device current on this thread (the fake CUDA runtime's
// cudaSetDevice), as the runtime makes it.
EXPORT void fake_cuda_make_current(int device) {
  if (device < 0 || device >= g_devices) return;
  if (t_depth == 0) t_depth = 1;
  t_stack[t_depth - 1] = &g_contexts[device];
}

EXPORT CUresult cuMemGetInfo(size_t* free_bytes, size_t* total) {
  int device = current_device();
  if (device < 0) return kInvalidValue;  // the real driver needs a current context too
  *total = g_memory_bytes;
  *free_bytes = g_memory_bytes - atomic_load(&g_used[device]);
  return kSuccess;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t* granularity, const void* prop, int option) {
  (void)prop, (void)option;
  *granularity = GRANULARITY;
  return kSuccess;
}

// Reserved address ranges are inaccessible anonymous mappings, aligned to the granularity.
EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
  (void)addr, (void)flags;
  if (size == 0 || size % GRANULARITY != 0) return kInvalidValue;
  if (alignment < GRANULARITY) alignment = GRANULARITY;
  size_t span = size + alignment;
  char* base = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return kOutOfMemory;
  uintptr_t start = ((uintptr_t)base + alignment - 1) / alignment * alignment;
  if (start > (uintptr_t)base) munmap(base, start - (uintptr_t)base);
  uintptr_t end = start + size;
  if (end < (uintptr_t)base + span) munmap((void*)end, (uintptr_t)base + span - end);
  *ptr = start;
  return kSuccess;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  return munmap((void*)(uintptr_t)ptr, size) == 0 ? kSuccess : kInvalidValue;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const void* prop,
                            unsigned long long flags) {
  (void)flags;
  // CUmemAllocationProp: type, requested handle types, then location {type, id}. Host memory
  // (HOST_NUMA, a soft pause's copies) is not the device's: device -1, outside its memory.
  const int host = ((const int*)prop)[2] == LOCATION_HOST_NUMA;
  int device = host ? -1 : ((const int*)prop)[3];
  if (!host && (device < 0 || device >= g_devices)) return kInvalidDevice;
  if (fails("cuMemCreate")) return kUnknown;
  if (size == 0 || size % GRANULARITY != 0) return kInvalidValue;
  size_t used = host ? 0 : atomic_fetch_add(&g_used[device], size);
  if (!host && used + size > g_memory_bytes) {
    atomic_fetch_sub(&g_used[device], size);
    return kOutOfMemory;
  }
  struct Physical* p = malloc(sizeof(*p));
  int fd = memfd_create("fake-cuda-memory", MFD_CLOEXEC);
  if (p == NULL || fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    free(p);
    if (!host) atomic_fetch_sub(&g_used[device], size);
    return kOutOfMemory;
  }
  p->fd = fd;
  p->size = size;
  p->device = device;
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
  return kSuccess;
}

// The memory goes once released and unmapped: closing the file leaves its pages to the
// mappings that still hold them, as the driver does.
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  struct Physical* p = (struct Physical*)(uintptr_t)handle;
  if (p == NULL) return kInvalidValue;
  if (p->device >= 0) atomic_fetch_sub(&g_used[p->device], p->size);
  close(p->fd);
  free(p);
  return kSuccess;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
  (void)flags;
  struct Physical* p = (struct Physical*)(uintptr_t)handle;
  if (p == NULL || offset + size > p->size) return kInvalidValue;
  if (offset != 0 || size != p->size) return kNotSupported;  // as drivers 580 answer a part of a handle
  if (fails("cuMemMap")) return kUnknown;
  void* at = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset);
  return at == MAP_FAILED ? kOutOfMemory : kSuccess;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  void* at = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                  -1, 0);
  return at == MAP_FAILED ? kInvalidValue : kSuccess;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void* desc, size_t count) {
  (void)desc, (void)count;
  if (fails("cuMemSetAccess")) return kUnknown;
  return mprotect((void*)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0 ? kSuccess : kInvalidValue;
}

EXPORT CUresult cuMemHostRegister(void* ptr, size_t size, unsigned flags) {
  (void)ptr, (void)size, (void)flags;
  return fails("cuMemHostRegister") ? kOutOfMemory : kSuccess;
}

EXPORT CUresult cuMemHostUnregister(void* ptr) { (void)ptr; return kSuccess; }

EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned flags) {
  (void)flags;
  *stream = &g_stream;
  return kSuccess;
}

EXPORT CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t size, CUstream stream) {
  (void)stream;
  memcpy(dst, (const void*)(uintptr_t)src, size);
  return kSuccess;
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream stream) {
  (void)stream;
  memcpy((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, size);
  return kSuccess;
}

EXPORT CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t size, CUstream stream) {
  (void)stream;
  memcpy((void*)(uintptr_t)dst, src, size);
  return kSuccess;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t size, CUstream stream) {
  (void)stream;
  memset((void*)(uintptr_t)dst, value, size);
  return kSuccess;
}

EXPORT CUresult cuEventCreate(CUevent* event, unsigned flags) {
  (void)flags;
  *event = &g_event;
  return kSuccess;
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) { (void)event, (void)stream; return kSuccess; }
EXPORT CUresult cuEventSynchronize(CUevent event) { (void)event; return kSuccess; }
EXPORT CUresult cuEventDestroy(CUevent event) { (void)event; return kSuccess; }

EXPORT CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  int previous = t_capture_mode;
  t_capture_mode = *mode;
  *mode = previous;
  return kSuccess;
}

static const struct {
  const char* name;
  void* fn;
} kEntryPoints[] = {
    {"cuInit", (void*)cuInit},
    {"cuGetErrorName", (void*)cuGetErrorName},
    {"cuGetErrorString", (void*)cuGetErrorString},
    {"cuDeviceGetCount", (void*)cuDeviceGetCount},
    {"cuDeviceGet", (void*)cuDeviceGet},
    {"cuDeviceGetAttribute", (void*)cuDeviceGetAttribute},
    {"cuDriverGetVersion", (void*)cuDriverGetVersion},
    {"cuDeviceGetName", (void*)cuDeviceGetName},
    {"cuDeviceTotalMem", (void*)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", (void*)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxGetState", (void*)cuDevicePrimaryCtxGetState},
    {"cuCtxPushCurrent", (void*)cuCtxPushCurrent},
    {"cuCtxPopCurrent", (void*)cuCtxPopCurrent},
    {"cuCtxGetCurrent", (void*)cuCtxGetCurrent},
    {"cuCtxSynchronize", (void*)cuCtxSynchronize},
    {"cuStreamSynchronize", (void*)cuStreamSynchronize},
    {"cuMemGetInfo", (void*)cuMemGetInfo},
    {"cuMemGetAllocationGranularity", (void*)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", (void*)cuMemAddressReserve},
    {"cuMemAddressFree", (void*)cuMemAddressFree},
    {"cuMemCreate", (void*)cuMemCreate},
    {"cuMemRelease", (void*)cuMemRelease},
    {"cuMemMap", (void*)cuMemMap},
    {"cuMemUnmap", (void*)cuMemUnmap},
    {"cuMemSetAccess", (void*)cuMemSetAccess},
    {"cuMemHostRegister", (void*)cuMemHostRegister},
    {"cuMemHostUnregister", (void*)cuMemHostUnregister},
    {"cuStreamCreate", (void*)cuStreamCreate},
    {"cuMemcpyDtoHAsync", (void*)cuMemcpyDtoHAsync},
    {"cuMemcpyAsync", (void*)cuMemcpyAsync},
    {"cuMemcpyHtoDAsync", (void*)cuMemcpyHtoDAsync},
    {"cuMemsetD8Async", (void*)cuMemsetD8Async},
    {"cuEventCreate", (void*)cuEventCreate},
    {"cuEventRecord", (void*)cuEventRecord},
    {"cuEventSynchronize", (void*)cuEventSynchronize},
    {"cuEventDestroy", (void*)cuEventDestroy},
    {"cuThreadExchangeStreamCaptureMode", (void*)cuThreadExchangeStreamCaptureMode},
};

EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** fn, int version, unsigned long long flags,
                                   int* found) {
  (void)version, (void)flags;
  for (size_t i = 0; i < sizeof(kEntryPoints) / sizeof(kEntryPoints[0]); ++i) {
    if (strcmp(symbol, kEntryPoints[i].name) == 0) {
      *fn = kEntryPoints[i].fn;
      if (found != NULL) *found = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
      return kSuccess;
    }
  }
  *fn = NULL;
  if (found != NULL) *found = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
  return kNotFound;
}

// The memory this fake holds on a device, for tests that check what was released.
EXPORT size_t fake_cuda_used_bytes(int device) {
  return device >= 0 && device < MAX_DEVICES ? atomic_load(&g_used[device]) : 0;
}
