// Host memory that holds the content of paused allocations.
//
// A pause takes one HostArena for all the backups it needs and carves it into one
// HostBuffer per allocation. Worker threads prepare the arena chunk by chunk (fault the
// pages in, with transparent huge pages, then page-lock them for DMA); a copy into a chunk
// starts as soon as that chunk is ready, so preparing host memory overlaps the transfer.
// An arena lives as long as any buffer cut from it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend.h"
#include "status.h"

namespace tmsl {

class HostArena {
 public:
  // Each chunk is registered on its own, so a DMA copy must not cross a chunk boundary.
  static constexpr size_t kChunkBytes = 64 << 20;

  // Maps the memory and starts preparing it; fails with Code::kOutOfMemory when the host
  // cannot provide it.
  static Status create(Backend* backend, int device, size_t size, std::shared_ptr<HostArena>* out);
  ~HostArena();  // waits for its workers, unregisters, unmaps
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Blocks until the chunk holding `offset` is prepared; its error if preparing it failed.
  Status wait_ready(size_t offset);

 private:
  HostArena(Backend* backend, int device, char* data, size_t size);
  void prepare(size_t first_chunk, size_t stride);

  struct Chunk {
    bool done = false;
    bool registered = false;
    Status status;
  };

  Backend* const backend_;
  const int device_;
  char* const data_;
  const size_t size_;
  std::mutex mu_;
  std::condition_variable chunk_done_;
  std::vector<Chunk> chunks_;
  std::vector<std::thread> workers_;
};

// One allocation's backup: a slice of an arena.
struct HostBuffer {
  std::shared_ptr<HostArena> arena;
  size_t offset = 0;
  size_t size = 0;

  explicit operator bool() const { return arena != nullptr; }
  char* data() const { return arena->data() + offset; }
  // Calls fn(offset within the buffer, host pointer, length) for each piece of the buffer
  // that lies within one arena chunk, after waiting for that chunk; stops at an error.
  Status for_each_chunk(const std::function<Status(size_t, char*, size_t)>& fn) const;
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
