// The copies a pause has queued, with a mark after each allocation's: an allocation may be
// released once its mark is reached, while the copies of the next ones still run.
#pragma once

#include <cstddef>
#include <set>
#include <vector>

#include "platform/backend.h"
#include "platform/status.h"

namespace tmsl {

class CopyMarks {
 public:
  // For a batch of `count` allocations on `devices`.
  CopyMarks(Backend& backend, size_t count, std::set<int> devices)
      : backend_(backend), marks_(count), devices_(std::move(devices)) {}
  ~CopyMarks() { finish(); }
  CopyMarks(const CopyMarks&) = delete;
  CopyMarks& operator=(const CopyMarks&) = delete;

  // Call before queuing an allocation's copies: until its mark, finish() cannot rely on
  // the marks alone.
  void begin() { unmarked_ = true; }
  // Marks the end of allocation i's copies, queued on `device` just before.
  Status mark(size_t i, int device) {
    CopyMark m = 0;
    Status s = backend_.mark_copies(device, &m);
    if (s.ok()) {
      marks_[i] = Pending{device, m, true};
      unmarked_ = false;
    }
    return s;
  }
  // Returns once allocation i's copies have landed (at once where it has none).
  Status wait(size_t i) {
    Pending& p = marks_[i];
    if (!p.pending) return Status::Ok();
    p.pending = false;
    Status s = backend_.wait_copy_mark(p.device, p.mark);
    if (!s.ok()) unmarked_ = true;  // copies up to it may still run: finish() waits for the streams
    return s;
  }
  // Waits for every copy still queued and frees the marks left: needed before any backup is
  // let go after an error, since copies in flight still write into its host memory. Every
  // copy lies before some mark unless queuing failed midway: only then the streams are
  // waited for as a whole.
  void finish() {
    if (unmarked_) {
      for (int device : devices_) backend_.wait_copies(device);  // a failure here was reported already
      unmarked_ = false;
    }
    for (size_t i = 0; i < marks_.size(); ++i) wait(i);
  }

 private:
  struct Pending {
    int device = 0;
    CopyMark mark = 0;
    bool pending = false;
  };
  Backend& backend_;
  std::vector<Pending> marks_;
  bool unmarked_ = false;  // copies were queued after the last mark
  const std::set<int> devices_;
};

}  // namespace tmsl
