// CUDA backend: the driver's virtual memory management API, opened at run time.
//
// The driver is opened when the backend is first created, through the one loader
// (platform/driver.h: libcuda at run time, entry points at the CUDA 12.0 ABI).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "platform/backend.h"
#include "platform/driver.h"

namespace tmsl {
namespace {

// CUDA 12.2's host memory the GPU maps (soft pauses), spelled as numbers so that older headers
// build too (a driver before 12.2 refuses them at run time: the pause copies as before).
constexpr CUmemLocationType kLocationHostNuma = static_cast<CUmemLocationType>(3);  // CU_MEM_LOCATION_TYPE_HOST_NUMA
constexpr CUdevice_attribute kAttributeHostNumaId = static_cast<CUdevice_attribute>(134);  // ..._HOST_NUMA_ID

struct DriverApi {
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuInit_v2000 cuInit = nullptr;
  PFN_cuDeviceGetCount_v2000 cuDeviceGetCount = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 cuDevicePrimaryCtxRetain = nullptr;
  PFN_cuCtxPushCurrent_v4000 cuCtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 cuCtxPopCurrent = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuCtxSynchronize_v2000 cuCtxSynchronize = nullptr;
  PFN_cuStreamSynchronize_v2000 cuStreamSynchronize = nullptr;
  PFN_cuMemGetInfo_v3020 cuMemGetInfo = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemHostRegister_v6050 cuMemHostRegister = nullptr;
  PFN_cuMemHostUnregister_v4000 cuMemHostUnregister = nullptr;
  PFN_cuStreamCreate_v2000 cuStreamCreate = nullptr;
  PFN_cuMemcpyDtoHAsync_v3020 cuMemcpyDtoHAsync = nullptr;
  PFN_cuMemcpyHtoDAsync_v3020 cuMemcpyHtoDAsync = nullptr;
  PFN_cuMemcpyAsync_v4000 cuMemcpyAsync = nullptr;
  PFN_cuMemsetD8Async_v3020 cuMemsetD8Async = nullptr;
  PFN_cuEventCreate_v2000 cuEventCreate = nullptr;
  PFN_cuEventRecord_v2000 cuEventRecord = nullptr;
  PFN_cuEventSynchronize_v2000 cuEventSynchronize = nullptr;
  PFN_cuEventDestroy_v4000 cuEventDestroy = nullptr;
  PFN_cuThreadExchangeStreamCaptureMode_v10010 cuThreadExchangeStreamCaptureMode = nullptr;
  // The content fingerprint's (optional: without them the backend copies instead).
  PFN_cuModuleLoadData_v2000 cuModuleLoadData = nullptr;
  PFN_cuModuleGetFunction_v2000 cuModuleGetFunction = nullptr;
  PFN_cuLaunchKernel_v4000 cuLaunchKernel = nullptr;
  PFN_cuMemAlloc_v3020 cuMemAlloc = nullptr;
  PFN_cuStreamWaitEvent_v3020 cuStreamWaitEvent = nullptr;
  PFN_cuMemHostGetDevicePointer_v3020 cuMemHostGetDevicePointer = nullptr;
  bool fingerprints() const {
    return cuModuleLoadData && cuModuleGetFunction && cuLaunchKernel && cuMemAlloc && cuStreamWaitEvent &&
           cuMemHostGetDevicePointer;
  }
};

// Page-locking host memory counts as "unsafe" while any thread captures a CUDA graph in
// global mode (torch's default): made then, from the background threads that prepare and
// free backups, it would invalidate the user's capture. It enqueues nothing on any stream,
// so the calling thread relaxes its capture mode for the call (as torch's own allocator
// does around cudaMalloc).
class RelaxedCapture {
 public:
  explicit RelaxedCapture(const DriverApi& api) : api_(api) {
    relaxed_ = api_.cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
  }
  ~RelaxedCapture() {
    if (relaxed_) api_.cuThreadExchangeStreamCaptureMode(&mode_);  // the thread's own mode back
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  const DriverApi& api_;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  bool relaxed_ = false;
};

Status load_driver(DriverApi* api) {
  DriverLibrary driver;
  Status opened = DriverLibrary::open(&driver);
  if (!opened.ok() && driver.path().empty()) {
    return Status::Error(Code::kNoDriver, "no CUDA driver: " + opened.message() +
                                              "; install the NVIDIA driver or run on a GPU machine");
  }
  if (!opened.ok()) return opened;
  std::string missing;
  auto resolve = [&](const char* symbol, auto* field) { driver.resolve(symbol, field, &missing); };
  resolve("cuGetErrorName", &api->cuGetErrorName);
  resolve("cuGetErrorString", &api->cuGetErrorString);
  resolve("cuInit", &api->cuInit);
  resolve("cuDeviceGetCount", &api->cuDeviceGetCount);
  resolve("cuDeviceGet", &api->cuDeviceGet);
  resolve("cuDeviceGetAttribute", &api->cuDeviceGetAttribute);
  resolve("cuDevicePrimaryCtxRetain", &api->cuDevicePrimaryCtxRetain);
  resolve("cuCtxPushCurrent", &api->cuCtxPushCurrent);
  resolve("cuCtxPopCurrent", &api->cuCtxPopCurrent);
  resolve("cuCtxGetCurrent", &api->cuCtxGetCurrent);
  resolve("cuCtxSynchronize", &api->cuCtxSynchronize);
  resolve("cuStreamSynchronize", &api->cuStreamSynchronize);
  resolve("cuMemGetInfo", &api->cuMemGetInfo);
  resolve("cuMemGetAllocationGranularity", &api->cuMemGetAllocationGranularity);
  resolve("cuMemAddressReserve", &api->cuMemAddressReserve);
  resolve("cuMemAddressFree", &api->cuMemAddressFree);
  resolve("cuMemCreate", &api->cuMemCreate);
  resolve("cuMemRelease", &api->cuMemRelease);
  resolve("cuMemMap", &api->cuMemMap);
  resolve("cuMemUnmap", &api->cuMemUnmap);
  resolve("cuMemSetAccess", &api->cuMemSetAccess);
  resolve("cuMemHostRegister", &api->cuMemHostRegister);
  resolve("cuMemHostUnregister", &api->cuMemHostUnregister);
  resolve("cuStreamCreate", &api->cuStreamCreate);
  resolve("cuMemcpyDtoHAsync", &api->cuMemcpyDtoHAsync);
  resolve("cuMemcpyHtoDAsync", &api->cuMemcpyHtoDAsync);
  resolve("cuMemcpyAsync", &api->cuMemcpyAsync);
  resolve("cuMemsetD8Async", &api->cuMemsetD8Async);
  resolve("cuEventCreate", &api->cuEventCreate);
  resolve("cuEventRecord", &api->cuEventRecord);
  resolve("cuEventSynchronize", &api->cuEventSynchronize);
  resolve("cuEventDestroy", &api->cuEventDestroy);
  resolve("cuThreadExchangeStreamCaptureMode", &api->cuThreadExchangeStreamCaptureMode);
  if (!missing.empty()) {
    return Status::Error(Code::kNoDriver, "the CUDA driver lacks entry points: " + missing);
  }
  std::string optional;
  driver.resolve("cuModuleLoadData", &api->cuModuleLoadData, &optional);
  driver.resolve("cuModuleGetFunction", &api->cuModuleGetFunction, &optional);
  driver.resolve("cuLaunchKernel", &api->cuLaunchKernel, &optional);
  driver.resolve("cuMemAlloc", &api->cuMemAlloc, &optional);
  driver.resolve("cuStreamWaitEvent", &api->cuStreamWaitEvent, &optional);
  driver.resolve("cuMemHostGetDevicePointer", &api->cuMemHostGetDevicePointer, &optional);
  return Status::Ok();
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const DriverApi& api) : api_(api) {}

  Status init() {
    Status s = check(api_.cuInit(0), "cuInit");
    if (!s.ok()) return s;
    int count = 0;
    s = check(api_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (!s.ok()) return s;
    devices_ = std::make_unique<DeviceState[]>(static_cast<size_t>(count));
    device_count_ = static_cast<size_t>(count);
    return Status::Ok();
  }

  const char* name() const override { return "cuda"; }

  Status granularity(int device, size_t* out) override {
    Status s = device_state(device);
    if (s.ok()) *out = devices_[device].granularity;
    return s;
  }

  Status reserve(int device, size_t size, size_t alignment, uintptr_t* va) override {
    return in_context(device, [&] {
      // The driver's own alignment first (0), as cudaMalloc and torch_memory_saver get it (it
      // aligns larger ranges more coarsely, at no cost: benchmarks/probes/README.md#driver-alignment).
      // Asked for explicitly where the driver's falls short of the granularity.
      CUdeviceptr ptr = 0;
      auto what = [&] { return "cuMemAddressReserve(" + format_bytes(size) + ")"; };
      Status s = check(api_.cuMemAddressReserve(&ptr, size, 0, 0, 0), what);
      if (s.ok() && ptr % alignment != 0) {
        api_.cuMemAddressFree(ptr, size);
        ptr = 0;
        s = check(api_.cuMemAddressReserve(&ptr, size, alignment, 0, 0), what);
      }
      *va = static_cast<uintptr_t>(ptr);
      return s;
    });
  }

  Status free_reservation(int device, uintptr_t va, size_t size) override {
    return in_context(device,
                      [&] { return check(api_.cuMemAddressFree(va, size), "cuMemAddressFree"); });
  }

  Status create_physical(int device, size_t size, PhysicalHandle* out) override {
    return in_context(device, [&] {
      CUmemAllocationProp prop = allocation_prop(device);
      CUmemGenericAllocationHandle handle = 0;
      Status s = check(api_.cuMemCreate(&handle, size, &prop, 0), [&] {
        return "cuMemCreate(" + format_bytes(size) + " on device " + std::to_string(device) + ")";
      });
      *out = static_cast<PhysicalHandle>(handle);
      return s;
    });
  }

  Status create_host_physical(int device, size_t size, PhysicalHandle* out) override {
    return in_context(device, [&] {
      CUmemAllocationProp prop = {};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = kLocationHostNuma;
      prop.location.id = devices_[device].host_numa;
      CUmemGenericAllocationHandle handle = 0;
      CUresult result = api_.cuMemCreate(&handle, size, &prop, 0);
      *out = static_cast<PhysicalHandle>(handle);
      if (result == CUDA_ERROR_NOT_SUPPORTED || result == CUDA_ERROR_INVALID_VALUE) {
        // A driver before CUDA 12.2, or a host without NUMA nodes it knows.
        return Status::Error(Code::kUnsupported, "cuMemCreate of host memory (HOST_NUMA) is not supported here");
      }
      return check(result, [&] { return "cuMemCreate(" + format_bytes(size) + " of host memory)"; });
    });
  }

  Status set_host_access(int device, uintptr_t va, size_t size) override {
    return in_context(device, [&] {
      CUmemAccessDesc desc[2] = {};
      desc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      desc[0].location.id = device;
      desc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      desc[1].location.type = kLocationHostNuma;
      desc[1].location.id = devices_[device].host_numa;
      desc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      return check(api_.cuMemSetAccess(va, size, desc, 2), "cuMemSetAccess(host and device)");
    });
  }

  Status release_physical(int device, PhysicalHandle handle, size_t) override {
    return in_context(device, [&] { return check(api_.cuMemRelease(handle), "cuMemRelease"); });
  }

  Status map(int device, uintptr_t va, size_t size, PhysicalHandle handle) override {
    return in_context(device,
                      [&] { return check(api_.cuMemMap(va, size, 0, handle, 0), "cuMemMap"); });
  }

  Status unmap(int device, uintptr_t va, size_t size) override {
    return in_context(device, [&] { return check(api_.cuMemUnmap(va, size), "cuMemUnmap"); });
  }

  Status set_access(int device, uintptr_t va, size_t size) override {
    return in_context(device, [&] {
      CUmemAccessDesc desc = {};
      desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      desc.location.id = device;
      desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      return check(api_.cuMemSetAccess(va, size, &desc, 1), "cuMemSetAccess");
    });
  }

  Status register_host(int device, void* ptr, size_t size, bool read_only) override {
    RelaxedCapture relaxed(api_);
    const unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | (read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0);
    return in_context(device, [&] {
      return check(api_.cuMemHostRegister(ptr, size, flags),
                   [&] { return "cuMemHostRegister(" + format_bytes(size) + ")"; });
    });
  }

  Status unregister_host(int device, void* ptr) override {
    RelaxedCapture relaxed(api_);
    return in_context(device, [&] { return check(api_.cuMemHostUnregister(ptr), "cuMemHostUnregister"); });
  }

  Status copy_to_host_async(int device, void* dst, uintptr_t src, size_t size) override {
    return in_context(device, [&] {
      return check(api_.cuMemcpyDtoHAsync(dst, src, size, devices_[device].copy_stream),
                   "cuMemcpyDtoHAsync");
    });
  }

  Status copy_from_host_async(int device, uintptr_t dst, const void* src, size_t size) override {
    return in_context(device, [&] {
      return check(api_.cuMemcpyHtoDAsync(dst, src, size, devices_[device].copy_stream),
                   "cuMemcpyHtoDAsync");
    });
  }

  Status copy_async(int device, uintptr_t dst, uintptr_t src, size_t size) override {
    return in_context(device, [&] {
      return check(api_.cuMemcpyAsync(dst, src, size, devices_[device].copy_stream), "cuMemcpyAsync");
    });
  }

  Status fill_async(int device, uintptr_t va, size_t size, unsigned char value) override {
    return in_context(device, [&] {
      return check(api_.cuMemsetD8Async(va, value, size, devices_[device].copy_stream),
                   "cuMemsetD8Async");
    });
  }

  Status wait_copies(int device) override {
    return in_context(device, [&] {
      return check(api_.cuStreamSynchronize(devices_[device].copy_stream), "cuStreamSynchronize");
    });
  }

  Status mark_copies(int device, CopyMark* out) override {
    return in_context(device, [&] {
      CUevent event = nullptr;
      Status s = check(api_.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      if (!s.ok()) return s;
      s = check(api_.cuEventRecord(event, devices_[device].copy_stream), "cuEventRecord");
      if (!s.ok()) {
        api_.cuEventDestroy(event);
        return s;
      }
      *out = reinterpret_cast<CopyMark>(event);
      return s;
    });
  }

  Status wait_copy_mark(int device, CopyMark mark) override {
    return in_context(device, [&] {
      CUevent event = reinterpret_cast<CUevent>(mark);
      Status s = check(api_.cuEventSynchronize(event), "cuEventSynchronize");
      api_.cuEventDestroy(event);
      return s;
    });
  }

  Status synchronize_device(int device) override {
    return in_context(device, [&] { return check(api_.cuCtxSynchronize(), "cuCtxSynchronize"); });
  }

  Status synchronize_stream(int device, void* stream) override {
    return in_context(device, [&] {
      return check(api_.cuStreamSynchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize");
    });
  }

  Status memory_info(int device, size_t* free_bytes, size_t* total_bytes) override {
    return in_context(device,
                      [&] { return check(api_.cuMemGetInfo(free_bytes, total_bytes), "cuMemGetInfo"); });
  }

  Status fingerprint(int device, uintptr_t va, size_t bytes, const FingerprintKey& key, uint64_t* out,
                     const CopyMark* after) override {
    return in_context(device, [&] {
      // Share-ahead fingerprints from a background thread, maybe while the user captures a graph
      // in global mode: the key's upload (from pageable memory) and the waits count as unsafe
      // there and would invalidate that capture. Everything here goes on the fingerprint's own
      // stream, never a capturing one.
      RelaxedCapture relaxed(api_);
      std::lock_guard<std::mutex> lock(fingerprint_mu_);  // one device buffer per device
      FingerprintState* state = nullptr;
      Status s = fingerprint_state(device, key, &state);
      if (!s.ok()) return s;
      // Its own stream: it runs beside the copies, after the marked ones where asked.
      CUstream stream = state->stream;
      if (after != nullptr) {
        s = check(api_.cuStreamWaitEvent(stream, reinterpret_cast<CUevent>(*after), 0), "cuStreamWaitEvent");
        if (!s.ok()) return s;
      }
      // A launch per portion of the memory whose segment values fit the device buffer.
      const size_t portion = FingerprintState::kSegments * kFingerprintSegmentBytes;
      for (size_t at = 0; at < bytes; at += portion) {
        const size_t n = std::min(portion, bytes - at);
        CUdeviceptr data = va + at, nh_key = state->key, poly_key = state->key + sizeof(key.nh),
                    values = state->device_values;
        unsigned long long blocks = n / kFingerprintBlockBytes;
        void* params[] = {&data, &blocks, &nh_key, &poly_key, &values};
        const unsigned grid = static_cast<unsigned>(fingerprint_segments_in(n));
        s = check(api_.cuLaunchKernel(state->function, grid, 1, 1, 256, 1, 1, 0, stream, params, nullptr),
                  "cuLaunchKernel(fingerprint)");
        if (s.ok()) s = check(api_.cuStreamSynchronize(stream), "cuStreamSynchronize(fingerprint)");
        if (!s.ok()) return s;
        memcpy(out + at / kFingerprintSegmentBytes * kFingerprintLanes, state->values,
               grid * kFingerprintLanes * sizeof(uint64_t));
      }
      return Status::Ok();
    });
  }

 private:
  struct DeviceState {
    std::atomic<bool> ready{false};  // set once the fields below are, for the process lifetime
    CUcontext context = nullptr;  // the primary context, retained for the process lifetime
    size_t granularity = 0;
    int host_numa = 0;  // the host NUMA node nearest the device (0 where the driver cannot say)
    CUstream copy_stream = nullptr;  // backups travel here, apart from the user's streams
  };

  static CUmemAllocationProp allocation_prop(int device) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
  }

  // `what` names the call in the error: a name, or a function that formats one, called only
  // on failure (formatting sizes for every call cost microseconds per allocation).
  Status check(CUresult result, const char* what) const {
    return result == CUDA_SUCCESS ? Status::Ok() : error(result, what);
  }
  template <typename Describe>
  Status check(CUresult result, Describe&& what) const {
    return result == CUDA_SUCCESS ? Status::Ok() : error(result, what());
  }

  Status error(CUresult result, const std::string& what) const {
    const char* name = nullptr;
    const char* text = nullptr;
    api_.cuGetErrorName(result, &name);
    api_.cuGetErrorString(result, &text);
    std::string message = what + " failed: " + (name ? name : "CUDA error " + std::to_string(result)) +
                          (text ? std::string(" (") + text + ")" : "");
    return Status::Error(result == CUDA_ERROR_OUT_OF_MEMORY ? Code::kOutOfMemory : Code::kDriverError,
                         message);
  }

  // Every driver call asks first: once a device is ready, the answer is one load.
  bool ready(int device) const {
    return device >= 0 && static_cast<size_t>(device) < device_count_ &&
           devices_[device].ready.load(std::memory_order_acquire);
  }

  Status device_state(int device) { return ready(device) ? Status::Ok() : prepare_device(device); }

  // Retains the device's primary context (the one torch and the runtime use) and checks
  // that it supports virtual memory management, once per device.
  __attribute__((noinline)) Status prepare_device(int device) {
    if (device < 0 || static_cast<size_t>(device) >= device_count_) {
      return Status::Error(Code::kInvalidArgument,
                           "device " + std::to_string(device) + " does not exist (" +
                               std::to_string(device_count_) + " CUDA devices visible)");
    }
    DeviceState& state = devices_[device];
    std::lock_guard<std::mutex> lock(mu_);
    if (state.ready.load(std::memory_order_relaxed)) return Status::Ok();
    CUdevice dev = 0;
    Status s = check(api_.cuDeviceGet(&dev, device), "cuDeviceGet");
    if (!s.ok()) return s;
    int vmm = 0;
    s = check(api_.cuDeviceGetAttribute(
                  &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
              "cuDeviceGetAttribute");
    if (!s.ok()) return s;
    if (!vmm) {
      return Status::Error(Code::kDriverError, "device " + std::to_string(device) +
                                                   " does not support CUDA virtual memory management");
    }
    int numa = -1;  // (CUDA 12.2's attribute; an older driver refuses it)
    if (api_.cuDeviceGetAttribute(&numa, kAttributeHostNumaId, dev) == CUDA_SUCCESS && numa > 0) {
      state.host_numa = numa;
    }
    CUmemAllocationProp prop = allocation_prop(device);
    s = check(api_.cuMemGetAllocationGranularity(&state.granularity, &prop,
                                                 CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity");
    if (!s.ok()) return s;
    CUcontext context = nullptr;
    s = check(api_.cuDevicePrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
    if (!s.ok()) return s;
    s = check(api_.cuCtxPushCurrent(context), "cuCtxPushCurrent");
    if (!s.ok()) return s;
    s = check(api_.cuStreamCreate(&state.copy_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    if (s.ok()) {
      std::lock_guard<std::mutex> fingerprint_lock(fingerprint_mu_);
      if (!fingerprint_.count(device)) prepare_fingerprints(device);  // (a failure: none, the pause copies)
    }
    CUcontext popped = nullptr;
    api_.cuCtxPopCurrent(&popped);
    if (s.ok()) {
      state.context = context;
      state.ready.store(true, std::memory_order_release);
    }
    return s;
  }

  // Runs `body` with the device's primary context current, and restores the caller's.
  template <typename Body>
  Status in_context(int device, Body&& body) {
    Status s = device_state(device);
    if (!s.ok()) return s;
    // Usually it is current already (torch's thread, its current device): then a push and a
    // pop would only add two driver calls to each operation.
    CUcontext current = nullptr;
    if (api_.cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == devices_[device].context) return body();
    s = check(api_.cuCtxPushCurrent(devices_[device].context), "cuCtxPushCurrent");
    if (!s.ok()) return s;
    s = body();
    CUcontext popped = nullptr;
    api_.cuCtxPopCurrent(&popped);
    return s;
  }

  // What a device needs to fingerprint: the kernel, its own stream, a small device buffer for
  // the key and page-locked host memory the kernel writes the segment values of one launch into
  // (no copy: a copy out would queue behind a pause's copies to the host). Made with the device
  // (prepare_device), so a pause never takes device memory, and kept: a fixed few MiB per device.
  struct FingerprintState {
    static constexpr size_t kSegments = 4096;  // segment values per launch: 1 GiB of memory
    CUfunction function = nullptr;
    CUdeviceptr key = 0;     // FingerprintKey's nh then poly, as the kernel reads them
    uint64_t* values = nullptr;  // kSegments * kFingerprintLanes values, page-locked, mapped
    CUdeviceptr device_values = 0;  // the same memory, as the device sees it
    CUstream stream = nullptr;  // its launches', apart from the copies and the user's streams
    FingerprintKey uploaded;
    bool failed = false;     // tried and refused: the caller copies instead
  };

  // Makes the device's fingerprint state; in its context, under fingerprint_mu_. A failure
  // leaves it marked failed (what was made is kept: it is never tried again).
  void prepare_fingerprints(int device) {
    RelaxedCapture relaxed(api_);  // a first allocation may come during a user's capture
    FingerprintState state;
    CUmodule module = nullptr;
    const size_t value_bytes = FingerprintState::kSegments * kFingerprintLanes * sizeof(uint64_t);
    Status s = api_.fingerprints() ? Status::Ok() : Status::Error(Code::kUnsupported, "the driver cannot launch kernels");
    if (s.ok()) s = check(api_.cuStreamCreate(&state.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate(fingerprint)");
    if (s.ok()) s = check(api_.cuModuleLoadData(&module, fingerprint_kernel_ptx()), "cuModuleLoadData(fingerprint)");
    if (s.ok()) s = check(api_.cuModuleGetFunction(&state.function, module, kFingerprintKernelName), "cuModuleGetFunction");
    if (s.ok()) s = check(api_.cuMemAlloc(&state.key, sizeof(FingerprintKey::nh) + sizeof(FingerprintKey::poly)), "cuMemAlloc(fingerprint key)");
    if (s.ok()) {
      state.values = static_cast<uint64_t*>(aligned_alloc(4096, value_bytes));
      if (state.values == nullptr) s = Status::Error(Code::kHostError, "no host memory for fingerprint values");
    }
    if (s.ok()) {
      s = check(api_.cuMemHostRegister(state.values, value_bytes, CU_MEMHOSTREGISTER_DEVICEMAP),
                "cuMemHostRegister(fingerprint values)");
    }
    if (s.ok()) {
      s = check(api_.cuMemHostGetDevicePointer(&state.device_values, state.values, 0), "cuMemHostGetDevicePointer");
    }
    state.failed = !s.ok();
    fingerprint_[device] = state;
  }

  // The device's state, its key uploaded if it changed; fingerprint_mu_ held, in its context.
  Status fingerprint_state(int device, const FingerprintKey& key, FingerprintState** out) {
    if (!fingerprint_.count(device)) prepare_fingerprints(device);
    FingerprintState& state = fingerprint_[device];
    if (state.failed) return Status::Error(Code::kUnsupported, "fingerprints failed on device " + std::to_string(device));
    if (memcmp(&state.uploaded, &key, sizeof(key)) != 0) {
      CUstream stream = state.stream;
      Status s = check(api_.cuMemcpyHtoDAsync(state.key, key.nh, sizeof(key.nh), stream), "cuMemcpyHtoDAsync(key)");
      if (s.ok()) s = check(api_.cuMemcpyHtoDAsync(state.key + sizeof(key.nh), key.poly, sizeof(key.poly), stream), "cuMemcpyHtoDAsync(key)");
      if (s.ok()) s = check(api_.cuStreamSynchronize(stream), "cuStreamSynchronize(key)");
      if (!s.ok()) return s;
      state.uploaded = key;
    }
    *out = &state;
    return Status::Ok();
  }

  const DriverApi api_;
  std::mutex mu_;
  std::mutex fingerprint_mu_;
  std::map<int, FingerprintState> fingerprint_;
  std::unique_ptr<DeviceState[]> devices_;
  size_t device_count_ = 0;
};

}  // namespace

Status make_cuda_backend(std::unique_ptr<Backend>* out) {
  DriverApi api;
  Status s = load_driver(&api);
  if (!s.ok()) return s;
  auto backend = std::make_unique<CudaBackend>(api);
  s = backend->init();
  if (!s.ok()) return s;
  *out = std::move(backend);
  return Status::Ok();
}

}  // namespace tmsl
