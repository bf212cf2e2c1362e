// Errors travel as values: nothing in the library throws across the C ABI or ends the
// process. A Status carries a code, a message for the user and, for out-of-memory, the
// figures the Python exception exposes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tmsl {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,
  kOutOfMemory = 2,
  kNoDriver = 3,
  kDriverError = 4,
  kHostError = 5,
  kTagPaused = 6,  // the operation needs the tag resident (entering or allocating in a paused tag)
};

struct OomDetail {
  std::string tag;
  size_t bytes_needed = 0;
  size_t bytes_free = 0;
  int device = -1;
};

struct Status {
  Code code = Code::kOk;
  std::string message;
  OomDetail oom;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
  static Status Error(Code code, std::string message) {
    Status s;
    s.code = code;
    s.message = std::move(message);
    return s;
  }
};

// "1.50 GiB", "2.00 MiB", "512 B": sizes in messages a person reads.
std::string format_bytes(size_t bytes);
// "0x7f12a0000000"
std::string format_address(uintptr_t address);
// Error from a failed system call: "<what>: <strerror(errno)>".
Status errno_status(const std::string& what, int err);

// Per-thread last error, read by the C ABI's tmsl_last_error_* functions.
void set_last_error(const Status& status);
const Status& last_error();

}  // namespace tmsl
