// Errors travel as values: nothing in the library throws across the C ABI or ends the
// process. A Status carries a code, a message for the user and, for out-of-memory, the
// figures the Python exception exposes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <string>

namespace tmsl {

// The one list of status codes: the enum below and the names the C ABI hands to Python
// (tmsl_status_names) are both made from it.
#define TMSL_STATUS_CODES(X)                                                              \
  X(kOk, "ok")                                                                            \
  X(kInvalidArgument, "invalid_argument")                                                 \
  X(kOutOfMemory, "out_of_memory")                                                        \
  X(kNoDriver, "no_driver")                                                               \
  X(kDriverError, "driver_error")                                                         \
  X(kHostError, "host_error")                                                             \
  X(kTagPaused, "tag_paused") /* entering or allocating in a paused tag */             \
  X(kUnsupported, "unsupported") /* the backend or driver cannot do it: the caller does without */ \
  X(kContentMismatch, "content_mismatch") /* a resume restored bytes other than its pause saw */

enum class Code : int {
#define TMSL_CODE_ENUM(name, text) name,
  TMSL_STATUS_CODES(TMSL_CODE_ENUM)
#undef TMSL_CODE_ENUM
};

// "ok,invalid_argument,...": the codes' names in code order.
const char* status_code_names();

struct OomDetail {
  std::string tag;
  size_t bytes_needed = 0;
  size_t bytes_free = 0;
  int device = -1;
};

// Success is a code alone: every driver call on an allocation's path returns a Status
// through several layers, so only a failure carries (and allocates) its message.
class Status {
 public:
  Code code = Code::kOk;

  Status() = default;
  Status(const Status& other) : code(other.code), detail_(other.detail_ ? new Detail(*other.detail_) : nullptr) {}
  Status& operator=(const Status& other) {
    if (this != &other) *this = Status(other);
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
  static Status Error(Code code, std::string message) {
    Status s;
    s.code = code;
    s.detail_.reset(new Detail{std::move(message), {}});
    return s;
  }

  const std::string& message() const { return detail_ ? detail_->message : kNoMessage(); }
  void set_message(std::string message) { detail().message = std::move(message); }
  const OomDetail& oom() const { return detail_ ? detail_->oom : kNoOom(); }
  void set_oom(OomDetail oom) { detail().oom = std::move(oom); }

 private:
  struct Detail {
    std::string message;
    OomDetail oom;
  };
  Detail& detail() {
    if (!detail_) detail_.reset(new Detail());
    return *detail_;
  }
  static const std::string& kNoMessage() {
    static const std::string empty;
    return empty;
  }
  static const OomDetail& kNoOom() {
    static const OomDetail none;
    return none;
  }
  std::unique_ptr<Detail> detail_;
};

// `text` as a JSON string literal, quotes included (stats and the driver report).
std::string json_string(const std::string& text);
// "1.50 GiB", "2.00 MiB", "512 B": sizes in messages a person reads.
std::string format_bytes(size_t bytes);
// "0x7f12a0000000"
std::string format_address(uintptr_t address);
// Error from a failed system call: "<what>: <strerror(errno)>".
Status errno_status(const std::string& what, int err);
// `s` with "<context>: " before its message when it is an error; success passes through.
Status with_context(Status s, const std::string& context);
// For the calls on every allocation's path: no string is built unless there is an error.
inline Status with_context(Status s, const char* context) {
  return s.ok() ? s : with_context(std::move(s), std::string(context));
}

// Runs `body` (returning a Status) and turns any C++ exception it throws into a Status, so
// an operation that must settle its state afterwards always gets to.
template <typename Body>
Status status_of(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Status::Error(Code::kOutOfMemory, "out of host memory for bookkeeping");
  } catch (const std::exception& e) {
    return Status::Error(Code::kHostError, std::string("internal error: ") + e.what());
  } catch (...) {
    return Status::Error(Code::kHostError, "internal error");
  }
}

// True in a child process forked from one that had made a saver: the parent's savers,
// threads and device memory are not the child's, so every saver call is refused there.
// (A fork before any saver existed is an ordinary process.)
bool in_forked_child();
void note_saver_made();
Status forked_child_error();

// Per-thread last error, read by the C ABI's tmsl_last_error_* functions.
void set_last_error(const Status& status);
const Status& last_error();

}  // namespace tmsl
