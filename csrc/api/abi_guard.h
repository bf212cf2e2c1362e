// The guard an exported function that returns a status code runs its body in (guarded, or a
// helper over it: on_saver here, c_api.cpp's on_tags, tms_compat.cpp's on_one_tag): a failed
// Status or any C++ exception becomes the calling thread's last error and a status code, so
// nothing escapes into the caller's C frames and nothing ends the process.
#pragma once

#include <exception>
#include <new>

#include "core/registry.h"
#include "platform/status.h"

namespace tmsl {

template <typename Body>
int guarded(Body&& body) {
  Status s = status_of(body);
  if (!s.ok()) set_last_error(s);
  return static_cast<int>(s.code);
}

// A counted reference to the live saver a handle names, held for the whole call.
inline Status live_saver(void* handle, SaverRef* out) {
  if (in_forked_child()) return forked_child_error();
  *out = find_saver(reinterpret_cast<SaverHandle>(handle));
  return *out ? Status::Ok() : Status::Error(Code::kInvalidArgument, "invalid or destroyed saver handle");
}

// guarded(), for a call on a saver handle that must be live.
template <typename Body>
int on_saver(void* handle, Body&& body) {
  return guarded([&] {
    SaverRef saver;
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
