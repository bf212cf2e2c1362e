#include "backup.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace tmsl {
namespace {

size_t worker_count(size_t chunks) {
  size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
  return std::min<size_t>({chunks, cores, 16});
}

}  // namespace

Status HostArena::create(Backend* backend, int device, size_t size, std::shared_ptr<HostArena>* out) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return errno_status("cannot allocate " + format_bytes(size) + " of host memory for backups", errno);
  }
  madvise(p, size, MADV_HUGEPAGE);  // advisory: a kernel without THP still works
  std::shared_ptr<HostArena> arena(new HostArena(backend, device, static_cast<char*>(p), size));
  // Worker t prepares chunks t, t + n, t + 2n, ...: the first chunks are ready first.
  const size_t workers = worker_count(arena->chunks_.size());
  for (size_t t = 0; t < workers; ++t) {
    arena->workers_.emplace_back([a = arena.get(), t, workers] { a->prepare(t, workers); });
  }
  *out = std::move(arena);
  return Status::Ok();
}

HostArena::HostArena(Backend* backend, int device, char* data, size_t size)
    : backend_(backend),
      device_(device),
      data_(data),
      size_(size),
      chunks_((size + kChunkBytes - 1) / kChunkBytes) {}

void HostArena::prepare(size_t first_chunk, size_t stride) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t c = first_chunk; c < chunks_.size(); c += stride) {
    char* start = data_ + c * kChunkBytes;
    const size_t length = std::min(kChunkBytes, size_ - c * kChunkBytes);
    // Fault the pages in here, in parallel, rather than inside the registration call.
    for (size_t off = 0; off < length; off += page) start[off] = 0;
    Status s = backend_->register_host(device_, start, length);
    {
      std::lock_guard<std::mutex> lock(mu_);
      chunks_[c].registered = s.ok();
      chunks_[c].status = std::move(s);
      chunks_[c].done = true;
    }
    chunk_done_.notify_all();
  }
}

Status HostArena::wait_ready(size_t offset) {
  std::unique_lock<std::mutex> lock(mu_);
  Chunk& chunk = chunks_[offset / kChunkBytes];
  chunk_done_.wait(lock, [&] { return chunk.done; });
  return chunk.status;
}

HostArena::~HostArena() {
  for (std::thread& worker : workers_) worker.join();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (chunks_[c].registered) backend_->unregister_host(device_, data_ + c * kChunkBytes);
  }
  munmap(data_, size_);
}

Status HostBuffer::for_each_chunk(const std::function<Status(size_t, char*, size_t)>& fn) const {
  size_t done = 0;
  while (done < size) {
    const size_t arena_offset = offset + done;
    Status s = arena->wait_ready(arena_offset);
    if (!s.ok()) return s;
    const size_t chunk_end = (arena_offset / HostArena::kChunkBytes + 1) * HostArena::kChunkBytes;
    const size_t length = std::min(size - done, chunk_end - arena_offset);
    s = fn(done, arena->data() + arena_offset, length);
    if (!s.ok()) return s;
    done += length;
  }
  return Status::Ok();
}

BackgroundReleaser::BackgroundReleaser() : worker_([this] { run(); }) {}

BackgroundReleaser::~BackgroundReleaser() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

void BackgroundReleaser::release(std::vector<HostBuffer> buffers) {
  if (buffers.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(buffers));
  }
  changed_.notify_all();
}

void BackgroundReleaser::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

void BackgroundReleaser::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    std::vector<HostBuffer> batch = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    batch.clear();  // the last reference to an arena frees it here
    lock.lock();
    busy_ = false;
    changed_.notify_all();
  }
}

}  // namespace tmsl
