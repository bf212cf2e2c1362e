// What the CUDA driver says, opened by the one loader the CUDA backend uses too
// (platform/driver.h), so the doctor and the breakdown state only facts this library checked:
// tmsl_driver_info_json (the driver and its GPUs) and tmsl_devices_with_context (which devices
// hold a primary context). Neither creates a context: cuInit and per-device queries only.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "api/abi_guard.h"
#include "api/c_api.h"
#include "platform/driver.h"

using namespace tmsl;

namespace {

struct DeviceFacts {
  int vmm = -1;  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; -1: not known
  size_t granularity = 0;  // 0: not known
  size_t total_bytes = 0;
  std::string name, error;
};

struct DriverFacts {
  std::string requested, path, error;
  bool loaded = false;
  int version = -1;
  std::vector<DeviceFacts> devices;
};

struct Api {
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuDriverGetVersion_v2020 cuDriverGetVersion = nullptr;
  PFN_cuInit_v2000 cuInit = nullptr;
  PFN_cuDeviceGetCount_v2000 cuDeviceGetCount = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetName_v2000 cuDeviceGetName = nullptr;
  PFN_cuDeviceTotalMem_v3020 cuDeviceTotalMem = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
};

// "cuInit failed: CUDA_ERROR_NO_DEVICE" (the name needs no cuInit).
std::string failed(const Api& api, const char* what, CUresult result) {
  const char* name = nullptr;
  if (api.cuGetErrorName == nullptr || api.cuGetErrorName(result, &name) != CUDA_SUCCESS || name == nullptr) {
    name = nullptr;
  }
  return std::string(what) + " failed: " + (name ? name : "CUDA error " + std::to_string(result));
}

// Resolves every entry point; the names of those missing, else "".
std::string resolve(const DriverLibrary& driver, Api* api) {
  std::string missing;
  auto one = [&](const char* symbol, auto* field) { driver.resolve(symbol, field, &missing); };
  one("cuGetErrorName", &api->cuGetErrorName);
  one("cuDriverGetVersion", &api->cuDriverGetVersion);
  one("cuInit", &api->cuInit);
  one("cuDeviceGetCount", &api->cuDeviceGetCount);
  one("cuDeviceGet", &api->cuDeviceGet);
  one("cuDeviceGetName", &api->cuDeviceGetName);
  one("cuDeviceTotalMem", &api->cuDeviceTotalMem);
  one("cuDeviceGetAttribute", &api->cuDeviceGetAttribute);
  one("cuMemGetAllocationGranularity", &api->cuMemGetAllocationGranularity);
  return missing;
}

DeviceFacts device_facts(const Api& api, int index) {
  DeviceFacts d;
  CUdevice dev = 0;
  CUresult r = api.cuDeviceGet(&dev, index);
  if (r != CUDA_SUCCESS) {
    d.error = failed(api, "cuDeviceGet", r);
    return d;
  }
  char name[256] = {};
  if ((r = api.cuDeviceGetName(name, sizeof(name) - 1, dev)) != CUDA_SUCCESS) d.error = failed(api, "cuDeviceGetName", r);
  d.name = name;
  if (d.error.empty() && (r = api.cuDeviceTotalMem(&d.total_bytes, dev)) != CUDA_SUCCESS) {
    d.error = failed(api, "cuDeviceTotalMem", r);
  }
  if (d.error.empty()) {
    r = api.cuDeviceGetAttribute(&d.vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
    if (r != CUDA_SUCCESS) {
      d.vmm = -1;
      d.error = failed(api, "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", r);
    }
  }
  if (d.error.empty() && d.vmm > 0) {
    CUmemAllocationProp prop = {};  // what the backend allocates: pinned device memory
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = index;
    r = api.cuMemGetAllocationGranularity(&d.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS) {
      d.granularity = 0;
      d.error = failed(api, "cuMemGetAllocationGranularity", r);
    }
  }
  return d;
}

DriverFacts probe() {
  DriverFacts f;
  DriverLibrary driver;
  Status opened = DriverLibrary::open(&driver);
  f.requested = driver.requested();
  f.path = driver.path();
  f.loaded = !f.path.empty();
  if (!opened.ok()) {
    // The missing entry point is named as the others would be.
    f.error = f.loaded ? "the CUDA driver lacks entry points: cuGetProcAddress_v2 (a driver for CUDA 12.0 or newer "
                         "is needed)"
                       : opened.message();
    return f;
  }
  Api api;
  std::string missing = resolve(driver, &api);
  if (!missing.empty()) {
    f.error = "the CUDA driver lacks entry points: " + missing;
    return f;
  }
  CUresult r = api.cuDriverGetVersion(&f.version);  // needs no cuInit
  if (r != CUDA_SUCCESS) {
    f.version = -1;
    f.error = failed(api, "cuDriverGetVersion", r);
    return f;
  }
  if ((r = api.cuInit(0)) != CUDA_SUCCESS) {
    f.error = failed(api, "cuInit", r);
    return f;
  }
  int count = 0;
  if ((r = api.cuDeviceGetCount(&count)) != CUDA_SUCCESS) {
    f.error = failed(api, "cuDeviceGetCount", r);
    return f;
  }
  for (int i = 0; i < count; ++i) f.devices.push_back(device_facts(api, i));
  return f;
}

std::string to_json(const DriverFacts& f) {
  std::string out = "{\"requested\":" + json_string(f.requested) + ",\"loaded\":" + (f.loaded ? "true" : "false") +
                    ",\"path\":" + (f.loaded ? json_string(f.path) : "null") + ",\"error\":" + json_string(f.error) +
                    ",\"version\":" + (f.version >= 0 ? std::to_string(f.version) : "null") + ",\"devices\":[";
  for (size_t i = 0; i < f.devices.size(); ++i) {
    const DeviceFacts& d = f.devices[i];
    out += std::string(i ? "," : "") + "{\"index\":" + std::to_string(i) + ",\"name\":" + json_string(d.name) +
           ",\"total_bytes\":" + (d.total_bytes ? std::to_string(d.total_bytes) : "null") +
           ",\"vmm\":" + (d.vmm < 0 ? "null" : d.vmm ? "true" : "false") +
           ",\"granularity\":" + (d.granularity ? std::to_string(d.granularity) : "null") +
           ",\"error\":" + json_string(d.error) + "}";
  }
  return out + "]}";
}

}  // namespace

TMSL_API int tmsl_driver_info_json(char* buf, size_t capacity, size_t* length) {
  return guarded([&] {
    Status s = require(length != nullptr, "length must not be NULL");
    if (!s.ok()) return s;
    std::string json = to_json(probe());
    *length = json.size();
    if (buf != nullptr && capacity > json.size()) memcpy(buf, json.c_str(), json.size() + 1);
    return s;
  });
}

TMSL_API int tmsl_devices_with_context(int* devices, size_t capacity, size_t* count) {
  return guarded([&] {
    Status s = require(count != nullptr && (devices != nullptr || capacity == 0),
                       "count must not be NULL, nor devices with a capacity");
    if (!s.ok()) return s;
    DriverLibrary driver;
    s = DriverLibrary::open(&driver);
    if (!s.ok()) return s;
    PFN_cuDeviceGetCount_v2000 get_count = nullptr;
    PFN_cuDeviceGet_v2000 get_device = nullptr;
    PFN_cuDevicePrimaryCtxGetState_v7000 get_state = nullptr;
    std::string missing;
    driver.resolve("cuDeviceGetCount", &get_count, &missing);
    driver.resolve("cuDeviceGet", &get_device, &missing);
    driver.resolve("cuDevicePrimaryCtxGetState", &get_state, &missing);
    if (!missing.empty()) return Status::Error(Code::kNoDriver, "the CUDA driver lacks entry points: " + missing);
    int total = 0;
    *count = 0;
    // Before cuInit (nobody made a context yet) the count fails: no device has one.
    if (get_count(&total) != CUDA_SUCCESS) return s;
    for (int i = 0; i < total; ++i) {
      CUdevice device = 0;
      unsigned int flags = 0;
      int active = 0;
      if (get_device(&device, i) != CUDA_SUCCESS || get_state(device, &flags, &active) != CUDA_SUCCESS || !active) {
        continue;
      }
      if (*count < capacity) devices[*count] = i;
      ++*count;
    }
    return s;
  });
}
