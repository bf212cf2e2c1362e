#include "backup.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace tmsl {
namespace {

constexpr size_t kRangeAlignment = 2 << 20;  // huge-page aligned: no page is in two ranges
constexpr size_t kBufferAlignment = 4096;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

size_t worker_count(size_t pieces) {
  size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
  return std::min<size_t>({pieces, cores, 16});
}

}  // namespace

Status HostArena::create(std::shared_ptr<Backend> backend, int device, const std::vector<size_t>& buffer_sizes,
                         std::shared_ptr<HostArena>* out) {
  std::shared_ptr<HostArena> arena(new HostArena(std::move(backend), device, buffer_sizes));
  void* p = mmap(nullptr, arena->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return errno_status("cannot allocate " + format_bytes(arena->size_) + " of host memory for backups", errno);
  }
  madvise(p, arena->size_, MADV_HUGEPAGE);  // advisory: a kernel without THP still works
  arena->data_ = static_cast<char*>(p);
  for (size_t t = 0, n = worker_count(arena->pieces_.size()); t < n; ++t) {
    try {
      arena->workers_.emplace_back([a = arena.get()] { a->prepare(); });
    } catch (const std::system_error&) {
      break;  // a thread or address-space limit: the workers that did start do it all
    }
  }
  if (arena->workers_.empty()) arena->prepare();  // not even one: prepare it right here
  *out = std::move(arena);
  return Status::Ok();
}

HostArena::HostArena(std::shared_ptr<Backend> backend, int device, const std::vector<size_t>& buffer_sizes)
    : backend_(std::move(backend)), device_(device) {
  // Buffers in order; a new range starts once the current one has kRangeBytes.
  for (size_t size : buffer_sizes) {
    if (ranges_.empty() || ranges_.back().size >= kRangeBytes) {
      size_ = round_up(size_, kRangeAlignment);
      ranges_.emplace_back();
      ranges_.back().start = size_;
    }
    buffer_offsets_.push_back(size_);
    size_ = round_up(size_ + size, kBufferAlignment);
    ranges_.back().size = size_ - ranges_.back().start;
  }
  for (size_t r = 0; r < ranges_.size(); ++r) {
    for (size_t at = 0; at < ranges_[r].size; at += kPieceBytes) {
      pieces_.push_back(Piece{r, ranges_[r].start + at, std::min(kPieceBytes, ranges_[r].size - at)});
      ++ranges_[r].pieces_left;
    }
    ranges_[r].done = ranges_[r].pieces_left == 0;  // only empty buffers: nothing to lock
  }
}

void HostArena::prepare() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // Pieces are taken in order, so the first ranges are ready first.
  for (size_t p = next_piece_++; p < pieces_.size(); p = next_piece_++) {
    const Piece& piece = pieces_[p];
    // Fault the pages in here, in parallel, rather than inside the registration call.
    for (size_t off = 0; off < piece.size; off += page) data_[piece.start + off] = 0;
    Range& range = ranges_[piece.range];
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--range.pieces_left != 0) continue;
    }
    // The range's last piece is in: page-lock all of it in one registration.
    Status s = backend_->register_host(device_, data_ + range.start, range.size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      range.registered = s.ok();
      range.status = std::move(s);
      range.done = true;
    }
    range_done_.notify_all();
  }
}

Status HostArena::wait_ready(size_t offset) {
  // The last range starting at or before `offset` holds it.
  auto after = std::upper_bound(ranges_.begin(), ranges_.end(), offset,
                                [](size_t at, const Range& r) { return at < r.start; });
  Range& range = *(after - 1);
  std::unique_lock<std::mutex> lock(mu_);
  range_done_.wait(lock, [&] { return range.done; });
  return range.status;
}

HostArena::~HostArena() {
  for (std::thread& worker : workers_) worker.join();
  for (const Range& range : ranges_) {
    if (range.registered) backend_->unregister_host(device_, data_ + range.start);
  }
  if (data_ != nullptr) munmap(data_, size_);
}

BackgroundReleaser::BackgroundReleaser() {
  try {
    worker_ = std::thread([this] { run(); });
  } catch (const std::system_error&) {
    // No thread to be had (a thread limit): release() frees on the caller's thread.
  }
}

BackgroundReleaser::~BackgroundReleaser() {
  if (!worker_.joinable()) return;
  if (in_forked_child()) {
    worker_.detach();  // it exists only in the parent; never wait for it here
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

void BackgroundReleaser::release(std::vector<HostBuffer> buffers) {
  if (buffers.empty()) return;
  if (!worker_.joinable() || in_forked_child()) {
    buffers.clear();  // freed here: there is no background thread to do it
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(buffers));
  }
  changed_.notify_all();
}

void BackgroundReleaser::wait_idle() {
  if (!worker_.joinable() || in_forked_child()) return;  // nothing is ever queued then
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
