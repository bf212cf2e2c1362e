#include "tiers/backup.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <new>
#include <system_error>

#ifndef MADV_POPULATE_WRITE  // Linux 5.14; older C libraries' headers lack it (the kernel answers EINVAL)
#define MADV_POPULATE_WRITE 23
#endif


namespace tmsl {
namespace {

// At process exit the driver is torn down while these threads may be inside it (faulting in
// or page-locking memory set aside a moment before, unpinning a backup): an exit handler
// stops them at their next step and waits, briefly, until none is inside.
std::atomic<bool> g_exiting{false};
std::mutex g_live_mu;
std::condition_variable g_live_changed;
int g_live = 0;  // threads doing arena or background work right now

void stop_background_threads_at_exit() {
  g_exiting.store(true);
  if (in_forked_child()) return;  // the parent's threads are not here to wait for
  std::unique_lock<std::mutex> lock(g_live_mu);
  g_live_changed.wait_for(lock, std::chrono::seconds(5), [] { return g_live == 0; });
}

// Counts the calling thread as live for its lifetime; registers the exit handler once.
class Live {
 public:
  Live() {
    static const bool registered = std::atexit(stop_background_threads_at_exit) == 0;
    (void)registered;
    std::lock_guard<std::mutex> lock(g_live_mu);
    ++g_live;
  }
  ~Live() {
    std::lock_guard<std::mutex> lock(g_live_mu);
    --g_live;
    g_live_changed.notify_all();
  }
  Live(const Live&) = delete;
  Live& operator=(const Live&) = delete;
};

constexpr size_t kRangeAlignment = 2 << 20;  // huge-page aligned: no page is in two ranges
constexpr size_t kBufferAlignment = 4096;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Background work has nobody to report to: a task says what went wrong its own way (a
// failed preparation just leaves the next pause to take host memory itself).
void run_quietly(const std::function<void()>& task) {
  try {
    task();
  } catch (...) {
  }
}


// Maps fresh private memory over [at, at + size) and fills it from the chunk open at `fd`.
bool private_copy(char* at, size_t size, int fd) {
  if (mmap(at, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) return false;
  HostArena::keep_from_children(at, size);
  return pread(fd, at, size, 0) == static_cast<ssize_t>(size);
}

}  // namespace

// A forked child gets none of an arena's pages (each new mapping over it is marked again): its
// savers refuse every call, and pages it kept would be memory the node's ledger counts as the
// parent's alone.
void HostArena::keep_from_children(void* at, size_t size) { madvise(at, size, MADV_DONTFORK); }

bool HostArena::private_memory_at(char* at, size_t size) {
  if (mmap(at, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) return false;
  madvise(at, size, MADV_HUGEPAGE);
  keep_from_children(at, size);
  return fault_in_pages(at, size, -1, 0, nullptr);
}

bool HostArena::fault_in_pages(char* at, size_t size, int file, size_t in_file, ChunkStore* store) {
  if (file >= 0) {
    // A file's pages are allocated in the file first: a full tmpfs answers ENOSPC here, where
    // a write to a page it cannot back would end the process with SIGBUS. The store's room is
    // looked at again (others may have filled it since the pause looked): what stays free for
    // everyone else is never taken.
    if (store == nullptr || store->room_of(file) < size) return false;
    if (fallocate(file, 0, static_cast<off_t>(in_file), static_cast<off_t>(size)) != 0) return false;
    // Then mapped in the kernel, in one call, where it can (Linux 5.14); else by a write to each.
    if (madvise(at, size, MADV_POPULATE_WRITE) == 0 || errno != EINVAL) return true;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (size_t off = 0; off < size; off += page) at[off] = 0;
  return true;
}

namespace {

size_t fault_in_workers(size_t pieces) {
  // One core is left to the thread that page-locks and the one that copies.
  size_t cores = std::max<size_t>(1, std::thread::hardware_concurrency());
  return std::min<size_t>({pieces, std::max<size_t>(1, cores - 1), 15});
}

}  // namespace

Status HostArena::create(std::shared_ptr<Backend> backend, HostBudget& budget, ForegroundGate& gate, bool urgent,
                         int device, const std::vector<size_t>& buffer_sizes, std::unique_ptr<HostArena>* out) {
  std::unique_ptr<HostArena> arena(new HostArena(std::move(backend), budget, nullptr, gate, urgent, device, buffer_sizes));
  Status reserved = budget.reserve(arena->used_);
  if (!reserved.ok()) return reserved;
  arena->reserved_ = true;
  arena->note_use();
  void* p = mmap(nullptr, arena->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return errno_status("cannot allocate " + format_bytes(arena->size_) + " of host memory for backups", errno);
  }
  madvise(p, arena->size_, MADV_HUGEPAGE);  // advisory: a kernel without THP still works
  keep_from_children(p, arena->size_);
  arena->data_ = static_cast<char*>(p);
  arena->start_workers();
  *out = std::move(arena);
  return Status::Ok();
}

HostArena::HostArena(std::shared_ptr<Backend> backend, HostBudget& budget, ChunkStore* store, ForegroundGate& gate,
                     bool urgent, int device, const std::vector<size_t>& buffer_sizes)
    : backend_(std::move(backend)), budget_(budget), store_(store), gate_(gate), urgent_(urgent), device_(device),
      buffer_sizes_(buffer_sizes) {
  // Buffers in order. Small ones share a range until it has kRangeBytes; a larger one starts
  // a range and is cut into ranges of kRangeBytes, and the buffer after it starts a new one.
  bool range_full = true;
  for (size_t size : buffer_sizes) {
    const bool large = size > kRangeBytes;
    if (range_full || large) start_range(round_up(size_, kRangeAlignment));
    const size_t offset = size_;
    buffer_offsets_.push_back(offset);
    for (size_t at = kRangeBytes; large && at < size; at += kRangeBytes) {
      ranges_.back().size = kRangeBytes;
      start_range(offset + at);
    }
    size_ = round_up(offset + size, kBufferAlignment);
    ranges_.back().size = size_ - ranges_.back().start;
    range_full = large || ranges_.back().size >= kRangeBytes;
  }
  for (size_t r = 0; r < ranges_.size(); ++r) {
    for (size_t at = 0; at < ranges_[r].size; at += kPieceBytes) {
      pieces_.push_back(Piece{r, ranges_[r].start + at, std::min(kPieceBytes, ranges_[r].size - at)});
      ++ranges_[r].pieces_left;
    }
  }
  ranges_left_ = ranges_.size();
  for (const Range& range : ranges_) used_ += range.size;
}

std::vector<std::pair<size_t, size_t>> HostArena::spans() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<size_t, size_t>> out;
  for (const Range& range : ranges_) {
    if (!out.empty() && out.back().second == range.start) {
      out.back().second += range.size;
    } else if (range.size != 0) {
      out.emplace_back(range.start, range.start + range.size);
    }
  }
  return out;
}

bool HostArena::poolable() {
  std::lock_guard<std::mutex> lock(mu_);
  return !leased_ && content_.empty() && !soft_ && !stopping();
}

void HostArena::start_workers() {
  auto start = [&](void (HostArena::*work)()) {
    try {
      workers_.emplace_back([this, work] { (this->*work)(); });
      return true;
    } catch (const std::exception&) {
      return false;  // a thread, memory or address-space limit: the caller does that part itself
    }
  };
  // Room for every thread first: a vector that failed to grow after the registrar started
  // would leave it waiting for pages nobody faults in.
  const size_t faulters = fault_in_workers(pieces_.size());
  workers_.reserve(faulters + 1);
  const bool registrar = start(&HostArena::page_lock);
  size_t faulting = 0;
  while (faulting < faulters && start(&HostArena::fault_in)) ++faulting;
  // Work done on the caller's thread is done now: giving way there would hold up whoever
  // waits for the caller (a pause waiting for the background thread's preparation).
  if (faulting == 0 || !registrar) hurry();
  if (faulting == 0) fault_in();
  if (!registrar) page_lock();
}

void HostArena::hurry() {
  if (urgent_.exchange(true)) return;
  gate_.poke();
}

void HostArena::give_way() {
  gate_.wait_quiet([this] { return urgent_.load() || stopping(); });
}

void HostArena::start_range(size_t at) {
  ranges_.emplace_back();
  ranges_.back().start = at;
  size_ = at;
}

void HostArena::note_use() {
  static std::atomic<uint64_t> uses{0};
  last_use_.store(++uses);
}

bool HostArena::stopping() const { return stopping_.load() || g_exiting.load(); }

void HostArena::fault_in() {
  Live live;
  // Pieces are taken in order, so the first ranges are ready first.
  for (size_t p = next_piece_++; p < pieces_.size() && !stopping(); p = next_piece_++) {
    const Piece& piece = pieces_[p];
    give_way();  // page faults take the process's memory-map lock, which the driver's calls need too
    if (stopping()) break;
    // Faulting the pages in here, in parallel, is much faster than inside the registration
    // (a new chunk's file pages above all: 4 KiB each, where /dev/shm has no huge pages).
    // (A new chunk's file that cannot get its pages gets private memory instead, from the
    // registrar: the pause goes on as with sharing off.)
    const bool room =
        fault_in_pages(data_ + piece.start, piece.size, ranges_[piece.range].new_fd, piece.start - ranges_[piece.range].start,
                       store_);
    std::lock_guard<std::mutex> lock(mu_);
    if (!room) ranges_[piece.range].no_room = true;
    if (--ranges_[piece.range].pieces_left == 0) changed_.notify_all();
  }
  if (stopping()) {
    std::lock_guard<std::mutex> lock(mu_);
    changed_.notify_all();  // the registrar and wait_prepared stop waiting for pages
  }
}

void HostArena::page_lock() {
  Live live;
  // One thread, in order: registrations on many threads at once run slower in the driver.
  // A content arena's chunks the store has come last: nothing is copied into them.
  std::vector<Range*> order;
  for (Range& range : ranges_) {
    if (range.shared_fd < 0 && !range.pending) order.push_back(&range);
  }
  for (Range& range : ranges_) {
    if (range.shared_fd >= 0 || range.pending) order.push_back(&range);
  }
  for (Range* next : order) {
    Range& range = *next;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] { return range.pieces_left == 0 || stopping(); });
      if (stopping()) {
        changed_.notify_all();
        return;
      }
    }
    give_way();
    if (range.no_room) {
      // A new chunk whose file got no pages (the store's file system filled up after the room
      // was checked): private memory in its place, never published, as with sharing off.
      if (ftruncate(range.new_fd, 0) != 0) {}  // (what pages it got go back; best effort)
      if (private_memory_at(data_ + range.start, range.size)) {
        std::lock_guard<std::mutex> lock(mu_);
        range.own = true;
        range.no_room = false;
        store_->discard_chunk(range.new_fd);  // no longer mapped: its memory is private now
        range.new_fd = -1;
      }
    }
    // A failure is not final: the range's first copy tries again (for_each_part).
    bool registered = range.size != 0 && !range.no_room &&
                      backend_->register_host(device_, data_ + range.start, range.size, range.shared_fd >= 0).ok();
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered && range.shared_fd >= 0 && unshare(range).ok()) {
      // A driver that cannot page-lock it read-only: private now, while nothing waits for the
      // room (a resume must never need room to copy it back).
      registered = backend_->register_host(device_, data_ + range.start, range.size, false).ok();
    }
    range.registered = registered;
    range.done = true;
    --ranges_left_;
    changed_.notify_all();
  }
}

void HostArena::wait_prepared() {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] { return ranges_left_ == 0 || stopping(); });
}

size_t HostArena::range_index(size_t offset) const {
  auto after = std::upper_bound(ranges_.begin(), ranges_.end(), offset,
                                [](size_t at, const Range& r) { return at < r.start; });
  return static_cast<size_t>(after - ranges_.begin()) - 1;
}

Status HostArena::for_each_part(size_t offset, size_t size, const std::function<Status(size_t, size_t)>& part) {
  hurry();  // a copy waits for these ranges
  for (size_t at = offset, end = offset + size; at < end;) {
    size_t range_end = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const size_t index = range_index(at);
      Range& range = ranges_[index];
      changed_.wait(lock, [&] { return range.done || stopping(); });
      // The process is ending (the registrar stopped without finishing this range).
      if (!range.done) return Status::Error(Code::kHostError, "the process is ending: backup host memory was not prepared");
      if (range.no_room) {
        return Status::Error(Code::kOutOfMemory, "the shared backup store has no room for a " + format_bytes(range.size) +
                                                     " chunk (a full /dev/shm)");
      }
      if (!range.registered && range.size != 0) {
        // Its page-locking failed (prepared in the background, perhaps long before), or it
        // lost it when register_as_one failed to put it back: try again now.
        Status s = backend_->register_host(device_, data_ + range.start, range.size, range.shared_fd >= 0);
        // A shared range the driver cannot page-lock read-only is made private again.
        if (!s.ok() && range.shared_fd >= 0 && unshare(range).ok()) {
          s = backend_->register_host(device_, data_ + range.start, range.size, false);
        }
        if (!s.ok()) return s;
        range.registered = true;
      }
      // Checked before each copy, for every reader (a resume says it in its own words first).
      std::string cut;
      if (!range_intact(index, &cut)) return Status::Error(Code::kHostError, cut);
      range_end = range.start + range.size;
    }
    if (range_end <= at) return Status::Error(Code::kHostError, "a backup lies outside its host memory ranges");
    const size_t n = std::min(end, range_end) - at;
    Status s = part(at, n);
    if (!s.ok()) return s;
    at += n;
  }
  return Status::Ok();
}

Status HostArena::register_as_one(size_t offset, size_t size) {
  if (size == 0) return Status::Ok();
  hurry();
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] { return ranges_left_ == 0; });
  leased_ = true;
  Status s = soft_ ? Status::Ok()  // one address range already, which copies may cross
             : !content_.empty() ? register_content_as_one()
                                 : register_ranges_as_one(offset, size);
  if (s.ok()) live_leases_.fetch_add(1);
  return s;
}

void HostArena::end_lease() { live_leases_.fetch_sub(1); }

Status HostArena::register_ranges_as_one(size_t offset, size_t size) {
  const size_t first = range_index(offset), last = range_index(offset + size - 1);
  if (first == last && (ranges_[first].registered || ranges_[first].size == 0)) return Status::Ok();
  // A large buffer's ranges hold nothing else: unregister them, register the span once.
  // (One range whose page-locking failed earlier is page-locked here too.)
  const size_t start = ranges_[first].start, end = ranges_[last].start + ranges_[last].size;
  for (size_t r = first; r <= last; ++r) {
    if (ranges_[r].registered) ranges_[r].registered = !backend_->unregister_host(device_, data_ + ranges_[r].start).ok();
  }
  Status s = backend_->register_host(device_, data_ + start, end - start, false);
  if (!s.ok()) {
    reregister_ranges();
    return s;
  }
  ranges_[first].size = end - start;
  ranges_[first].registered = true;
  ranges_.erase(ranges_.begin() + static_cast<std::ptrdiff_t>(first) + 1,
                ranges_.begin() + static_cast<std::ptrdiff_t>(last) + 1);
  return Status::Ok();
}

void HostArena::reregister_ranges() {
  // Back as it was, so the copies range by range still work; a range that cannot be
  // page-locked again now is tried again by the next copy (for_each_part).
  for (Range& range : ranges_) {
    if (!range.registered && range.size != 0) {
      range.registered = backend_->register_host(device_, data_ + range.start, range.size, range.shared_fd >= 0).ok();
    }
  }
}

Status HostArena::register_content_as_one() {
  // A user may write what is leased: every chunk of the store becomes this process's own
  // first. One it made and alone holds is taken back (unnamed: no copy, and its mapping here
  // is writable already); another's is copied into private memory, whose pages no
  // registration may pin meanwhile.
  for (Range& range : ranges_) {
    if (range.shared_fd < 0 || take_back(range)) continue;
    if (whole_registered_) {
      whole_registered_ = !backend_->unregister_host(device_, data_).ok();
      for (Range& any : ranges_) any.registered = whole_registered_;
    } else if (range.registered) {
      range.registered = !backend_->unregister_host(device_, data_ + range.start).ok();
    }
    Status s = range.registered ? Status::Error(Code::kHostError, "a shared backup range stayed page-locked")
                                : unshare(range);
    if (!s.ok()) return s;
  }
  if (whole_registered_) return Status::Ok();
  // The ranges stay the chunks they are (recycle() and publish() go by them); one
  // registration covers them all, so that a single copy may cross them.
  for (Range& range : ranges_) {
    if (range.registered) range.registered = !backend_->unregister_host(device_, data_ + range.start).ok();
  }
  const size_t end = ranges_.back().start + ranges_.back().size;
  Status s = backend_->register_host(device_, data_, end, false);
  if (!s.ok()) {
    reregister_ranges();
    return s;
  }
  whole_registered_ = true;
  for (Range& range : ranges_) range.registered = true;
  return Status::Ok();
}

HostArena::~HostArena() {
  {
    // Nobody holds a buffer of it any more: memory not yet prepared is not needed.
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true);
  }
  changed_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  if (soft_) {
    release_soft();
  } else {
    if (whole_registered_) {
      backend_->unregister_host(device_, data_);
    } else {
      for (const Range& range : ranges_) {
        if (range.registered) backend_->unregister_host(device_, data_ + range.start);
      }
    }
    if (data_ != nullptr) munmap(data_, size_);
  }
  for (const Range& range : ranges_) {
    if (range.shared_fd >= 0) store_->release_shared(range.shared_fd);
    if (range.new_fd >= 0) store_->discard_chunk(range.new_fd);
    if (range.claim_fd >= 0) store_->unclaim_chunk(content_[&range - ranges_.data()], range.claim_fd);
  }
  if (reserved_) budget_.give_back(used_ - shared_bytes_.load());
}

void HostArena::give_back_gently() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true);
  }
  changed_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
  if (soft_) return;  // its handles go with it, in the destructor
  for (Range& range : ranges_) {
    // A file's pages go when it is closed; one registration of them all goes with the arena.
    if (range.shared_fd >= 0 || range.new_fd >= 0 || range.pending || whole_registered_) continue;
    gate_.wait_quiet([] { return g_exiting.load(); });
    if (g_exiting.load()) return;  // the process is ending: the destructor does the rest at once
    if (range.registered) range.registered = !backend_->unregister_host(device_, data_ + range.start).ok();
    // Its pages go, its addresses stay (munmap here would let another mapping take them
    // before the destructor's munmap of the whole arena).
    if (!range.registered) madvise(data_ + range.start, range.size, MADV_DONTNEED);
  }
}

Status HostArena::unshare(Range& range) {
  const bool reserve = range.counted && reserved_;  // its bytes were given back when it was shared
  if (reserve) {
    Status s = budget_.reserve(range.size);
    if (!s.ok()) return s;
  }
  char* at = data_ + range.start;
  // Fresh private memory in its place, filled from the chunk (which holds the same bytes);
  // should that fail, the chunk is mapped there again.
  const bool back = private_copy(at, range.size, range.shared_fd);
  if (!back) {
    const int error = errno;
    if (mmap(at, range.size, PROT_READ, MAP_SHARED | MAP_FIXED, range.shared_fd, 0) != MAP_FAILED) {
      keep_from_children(at, range.size);
    }
    if (reserve) budget_.give_back(range.size);
    return errno_status("making a shared backup range private again", error);
  }
  store_->release_shared(range.shared_fd);
  range.shared_fd = -1;
  shared_ranges_--;
  if (range.counted) shared_bytes_ -= range.size;
  range.counted = false;
  return Status::Ok();
}

BackgroundWork::BackgroundWork() {
  try {
    worker_ = std::thread([this] { loop(); });
  } catch (const std::system_error&) {
    // No thread to be had (a thread limit): run() works on the caller's thread.
  }
}

BackgroundWork::~BackgroundWork() {
  if (!worker_.joinable()) return;
  if (in_forked_child()) {
    worker_.detach();  // it exists only in the parent; never wait for it here
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    stopping_flag_.store(true);
  }
  changed_.notify_all();
  worker_.join();
}

void BackgroundWork::run(std::function<void()> task) {
  if (worker_.joinable() && !in_forked_child()) {
    try {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
      changed_.notify_all();
      return;
    } catch (const std::bad_alloc&) {
      // No room in the queue: done here instead.
    }
  }
  run_quietly(task);  // there is no background thread to do it
}

void BackgroundWork::release(std::vector<HostBuffer> buffers) {
  if (buffers.empty()) return;
  // The last reference to an arena frees it where the task runs.
  run([batch = std::move(buffers)]() mutable { batch.clear(); });
}

void BackgroundWork::run_after_foreground(ForegroundGate& gate, std::function<void(bool in_background)> task) {
  run([this, &gate, task = std::move(task)] {
    const bool in_background = std::this_thread::get_id() == worker_.get_id();
    if (in_background) gate.wait_quiet([this] { return stopping_flag_.load() || g_exiting.load(); });
    task(in_background);
  });
}

void BackgroundWork::wait_idle() {
  if (!worker_.joinable() || in_forked_child()) return;  // nothing is ever queued then
  if (std::this_thread::get_id() == worker_.get_id()) return;  // a task cannot wait for itself
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [this] { return !busy_ && (queue_.empty() || g_exiting.load()); });
}

void BackgroundWork::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty() || g_exiting.load()) return;  // stopping, nothing left; or the process is ending
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    {
      Live live;
      run_quietly(task);
      task = nullptr;  // what it captured goes here, before the queue counts as idle
    }
    lock.lock();
    busy_ = false;
    changed_.notify_all();
  }
}

}  // namespace tmsl
