// Host memory that holds the content of paused allocations.
//
// A pause takes one HostArena for all the backups it needs and carves it into one
// HostBuffer per allocation. The arena is page-locked in ranges of whole buffers: one CUDA
// copy may not cross from one registration into the next (the driver answers "invalid
// value"), and users copy from backups with torch (get_cpu_backup(zero_copy=True)), so a
// buffer never spans two ranges. Worker threads fault the pages in, 64 MiB at a time and
// with transparent huge pages, and page-lock each range once its pages are in; a copy
// starts as soon as its buffer's range is ready, so preparing host memory overlaps the
// transfers. An arena lives as long as any buffer cut from it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend.h"
#include "status.h"

namespace tmsl {

class HostArena {
 public:
  // Buffers are grouped into page-locked ranges of at least this size (a larger buffer is
  // a range of its own): few registrations, and the first copies can start early.
  static constexpr size_t kRangeBytes = 64 << 20;
  // Pages are faulted in by the workers in pieces of at most this size.
  static constexpr size_t kPieceBytes = 64 << 20;

  // Maps memory for buffers of the given sizes and starts preparing it; fails with
  // Code::kOutOfMemory when the host cannot provide it.
  // The arena shares the backend: a backup leased out may outlive its saver.
  static Status create(std::shared_ptr<Backend> backend, int device, const std::vector<size_t>& buffer_sizes,
                       std::shared_ptr<HostArena>* out);
  ~HostArena();  // waits for its workers, unregisters, unmaps
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  char* data() const { return data_; }
  size_t buffer_offset(size_t i) const { return buffer_offsets_[i]; }
  // Blocks until the range holding `offset` is page-locked; its error if that failed.
  Status wait_ready(size_t offset);

 private:
  struct Range {
    size_t start = 0;
    size_t size = 0;
    size_t pieces_left = 0;
    bool done = false;
    bool registered = false;
    Status status;
  };
  struct Piece {
    size_t range;
    size_t start;
    size_t size;
  };

  HostArena(std::shared_ptr<Backend> backend, int device, const std::vector<size_t>& buffer_sizes);
  void prepare();  // one worker: fault in pieces in order, page-lock each range it completes

  const std::shared_ptr<Backend> backend_;
  const int device_;
  char* data_ = nullptr;
  size_t size_ = 0;
  std::vector<size_t> buffer_offsets_;
  std::vector<Range> ranges_;
  std::vector<Piece> pieces_;
  std::atomic<size_t> next_piece_{0};
  std::mutex mu_;
  std::condition_variable range_done_;
  std::vector<std::thread> workers_;
};

// One allocation's backup: a slice of an arena, inside one page-locked range.
struct HostBuffer {
  std::shared_ptr<HostArena> arena;
  size_t offset = 0;
  size_t size = 0;

  explicit operator bool() const { return arena != nullptr; }
  char* data() const { return arena->data() + offset; }
  // Blocks until the buffer is page-locked and may take a copy.
  Status wait_ready() const { return arena->wait_ready(offset); }
};

// Frees backups off the caller's thread: unpinning and unmapping gigabytes takes a good
// part of a second that a resume need not wait for.
class BackgroundReleaser {
 public:
  BackgroundReleaser();
  ~BackgroundReleaser();  // releases what is queued, then stops
  void release(std::vector<HostBuffer> buffers);
  void wait_idle();  // returns once everything handed over has been freed

 private:
  void run();
  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<std::vector<HostBuffer>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace tmsl
