#include "status.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace tmsl {

std::string format_bytes(size_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buf[48];
  if (unit == 0) {
    snprintf(buf, sizeof(buf), "%zu B", bytes);
  } else {
    snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  }
  return buf;
}

std::string format_address(uintptr_t address) {
  char buf[32];
  snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

Status errno_status(const std::string& what, int err) {
  Code code = (err == ENOMEM) ? Code::kOutOfMemory : Code::kHostError;
  return Status::Error(code, what + ": " + strerror(err));
}

const char* status_code_names() {
#define TMSL_CODE_NAME(name, text) "," text
  static const std::string names = std::string(TMSL_STATUS_CODES(TMSL_CODE_NAME)).substr(1);
#undef TMSL_CODE_NAME
  return names.c_str();
}

namespace {
thread_local Status t_last_error;
}

void set_last_error(const Status& status) { t_last_error = status; }
const Status& last_error() { return t_last_error; }

}  // namespace tmsl
