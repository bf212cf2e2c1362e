#include "platform/status.h"

#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace tmsl {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

Status with_context(Status s, const std::string& context) {
  if (!s.ok()) s.set_message(context + ": " + s.message());
  return s;
}

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

std::atomic<bool> g_saver_made{false};
std::atomic<bool> g_forked_child{false};
// Registered when the library loads: fork() marks the child of a process with savers.
const int g_fork_handler = pthread_atfork(nullptr, nullptr, [] {
  if (g_saver_made.load()) g_forked_child.store(true);
});
}  // namespace

bool in_forked_child() { return g_forked_child.load(std::memory_order_relaxed); }
void note_saver_made() { g_saver_made.store(true); }

Status forked_child_error() {
  return Status::Error(Code::kHostError,
                       "this process was forked from one that uses torch_mem_saver_lite; the parent's savers, "
                       "their threads and their memory do not carry over to a child, so savers cannot be used "
                       "here: start worker processes with the 'spawn' method, or use the library only in the parent");
}

void set_last_error(const Status& status) { t_last_error = status; }
const Status& last_error() { return t_last_error; }

}  // namespace tmsl
