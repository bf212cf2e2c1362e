// The one guard every exported function runs its body in: a failed Status or any C++
// exception becomes the calling thread's last error and a status code, so nothing escapes
// into the caller's C frames and nothing ends the process.
#pragma once

#include <exception>
#include <new>

#include "registry.h"
#include "status.h"

namespace tmsl {

template <typename Body>
int guarded(Body&& body) {
  Status s;
  try {
    s = body();
  } catch (const std::bad_alloc&) {
    s = Status::Error(Code::kOutOfMemory, "out of host memory for bookkeeping");
  } catch (const std::exception& e) {
    s = Status::Error(Code::kHostError, std::string("internal error: ") + e.what());
  } catch (...) {
    s = Status::Error(Code::kHostError, "internal error");
  }
  if (!s.ok()) set_last_error(s);
  return static_cast<int>(s.code);
}

inline Status live_saver(void* handle, Saver** out) {
  *out = find_saver(reinterpret_cast<SaverHandle>(handle));
  return *out != nullptr ? Status::Ok()
                         : Status::Error(Code::kInvalidArgument, "invalid or destroyed saver handle");
}

// guarded(), for a call on a saver handle that must be live.
template <typename Body>
int on_saver(void* handle, Body&& body) {
  return guarded([&] {
    Saver* saver = nullptr;
    Status s = live_saver(handle, &saver);
    return s.ok() ? body(*saver) : s;
  });
}

inline Status require(bool condition, const char* message) {
  return condition ? Status::Ok() : Status::Error(Code::kInvalidArgument, message);
}

// An allocation hook failed: its Status becomes the thread's last error, and Python, seeing
// torch's out-of-memory error leave a region, chains that error to it.
void note_allocation_failure(const Status& status);

}  // namespace tmsl
