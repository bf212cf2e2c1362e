// The one loader of the CUDA driver. The library links neither libcuda nor libcudart: it
// opens libcuda at run time (TMSL_CUDA_DRIVER_LIBRARY, else libcuda.so.1) and resolves each
// entry point with cuGetProcAddress at the CUDA 12.0 ABI, so one binary loads on machines
// without a GPU and serves drivers and torch builds of CUDA 12 and 13 alike. The CUDA backend,
// the doctor's report and the context query (breakdown) all open it here.
#pragma once

#include <string>

#include "platform/status.h"

namespace tmsl {

// The ABI version every entry point is requested at; callers' PFN_*_v* types must match it.
constexpr int kDriverAbiVersion = 12000;

class DriverLibrary {
 public:
  // Opens the driver (never closed: the process keeps it loaded, as the backend needs it).
  // kNoDriver says why not: "cannot load <path> (<why>)" (then path() is empty) or a driver
  // older than CUDA 12.0.
  static Status open(DriverLibrary* out);

  const std::string& requested() const { return requested_; }  // the name asked for
  const std::string& path() const { return path_; }            // the file the loader found

  // `symbol` at kDriverAbiVersion, or nullptr where the driver lacks it.
  void* entry(const char* symbol) const;

  // *fn = `symbol`; a missing one is added to `*missing` (", "-separated).
  template <class Fn>
  void resolve(const char* symbol, Fn* fn, std::string* missing) const {
    void* found = entry(symbol);
    if (found == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + symbol;
    *fn = reinterpret_cast<Fn>(found);
  }

 private:
  void* handle_ = nullptr;
  void* get_proc_ = nullptr;  // cuGetProcAddress_v2
  std::string requested_, path_;
};

}  // namespace tmsl
