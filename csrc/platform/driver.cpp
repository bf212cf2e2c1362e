#include "platform/driver.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <link.h>

#include "platform/environment.h"

namespace tmsl {

Status DriverLibrary::open(DriverLibrary* out) {
  DriverLibrary& d = *out;
  d = DriverLibrary{};
  d.requested_ = cuda_driver_library();
  d.handle_ = dlopen(d.requested_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (d.handle_ == nullptr) {
    const char* why = dlerror();
    return Status::Error(Code::kNoDriver,
                         "cannot load " + d.requested_ + " (" + (why ? why : "unknown reason") + ")");
  }
  struct link_map* map = nullptr;
  d.path_ = dlinfo(d.handle_, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr
                ? map->l_name
                : d.requested_;
  d.get_proc_ = dlsym(d.handle_, "cuGetProcAddress_v2");
  if (d.get_proc_ == nullptr) {
    return Status::Error(Code::kNoDriver,
                         "the CUDA driver is too old: cuGetProcAddress_v2 is missing; a driver for CUDA 12.0 "
                         "or newer is needed");
  }
  return Status::Ok();
}

void* DriverLibrary::entry(const char* symbol) const {
  if (get_proc_ == nullptr) return nullptr;
  void* fn = nullptr;
  CUdriverProcAddressQueryResult found;
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(get_proc_);
  if (get_proc(symbol, &fn, kDriverAbiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS) return nullptr;
  return fn;
}

}  // namespace tmsl
