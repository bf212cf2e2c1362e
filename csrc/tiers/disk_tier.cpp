#include "tiers/disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <system_error>
#include <thread>

#include "tiers/backup.h"
#include "tiers/disk_files.h"

namespace tmsl {
namespace {

constexpr size_t kAlignment = 4096;  // O_DIRECT: buffers, offsets and lengths in whole blocks

// The files alive in this process, removed by the exit handler: the process-wide saver is
// never destroyed, and its paused content is gone with the process anyway. Leaked on
// purpose, so that it outlives every static destructor.
struct LiveFiles {
  std::mutex mu;
  std::set<const DiskFile*> files;
};
LiveFiles& live_files() {
  static LiveFiles* live = new LiveFiles;
  return *live;
}

void remove_live_files_at_exit() {
  LiveFiles& live = live_files();
  std::lock_guard<std::mutex> lock(live.mu);
  for (const DiskFile* file : live.files) {
    if (file->made_here()) unlink(file->path().c_str());
  }
  live.files.clear();
}

void track(const DiskFile* file, bool alive) {
  static const bool registered = std::atexit(remove_live_files_at_exit) == 0;
  (void)registered;
  LiveFiles& live = live_files();
  std::lock_guard<std::mutex> lock(live.mu);
  if (alive) {
    live.files.insert(file);
  } else {
    live.files.erase(file);
  }
}

std::string quoted(const std::string& text) { return "'" + text + "'"; }

std::string describe(const std::vector<DiskRange>& ranges) {
  std::set<std::string> tags;
  size_t bytes = 0;
  for (const auto& r : ranges) tags.insert(r.tag), bytes += r.size;
  std::string names;
  for (const auto& t : tags) names += (names.empty() ? "" : ", ") + quoted(t);
  char size[32];
  snprintf(size, sizeof(size), "%.0f MiB", bytes / 1048576.0);
  return (tags.size() == 1 ? "tag " : "tags ") + names + " (" + size + ")";
}

// "[Errno 28] No space left on device", as the messages have always said it.
std::string os_error(int err) { return "[Errno " + std::to_string(err) + "] " + strerror(err); }

Status write_all(int fd, const char* data, size_t size, size_t offset) {
  while (size > 0) {
    const ssize_t n = pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::Error(Code::kHostError, os_error(n < 0 ? errno : EIO));
    data += n, size -= static_cast<size_t>(n), offset += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status read_all(int fd, char* data, size_t size, size_t offset) {
  while (size > 0) {
    const ssize_t n = pread(fd, data, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Error(Code::kHostError, os_error(errno));
    if (n == 0) {
      return Status::Error(Code::kHostError, os_error(EIO) + ": the disk backup file is shorter than what was "
                                                            "written to it");
    }
    data += n, size -= static_cast<size_t>(n), offset += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

DiskFile::DiskFile(std::string path, int fd, size_t size)
    : path_(std::move(path)), fd_(fd), size_(size), pid_(getpid()) {
  track(this, true);
}

bool DiskFile::made_here() const { return getpid() == pid_; }

DiskFile::~DiskFile() {
  track(this, false);
  if (made_here()) unlink(path_.c_str());  // before the lock goes: no cleaner sees it unheld
  close(fd_);
}

Status DiskTier::open(std::shared_ptr<Backend> backend, const std::string& path, std::shared_ptr<DiskTier>* out) {
  std::string real;
  Status s = check_directory(path, &real);
  if (!s.ok()) return s;
  std::shared_ptr<DiskTier> tier(new DiskTier(std::move(backend), real));
  const StaleFiles stale = remove_stale_files(real);
  if (!stale.removed_notice(real).empty()) tier->note(stale.removed_notice(real));
  if (!stale.foreign_notice(real).empty()) tier->note(stale.foreign_notice(real));
  *out = std::move(tier);
  return Status::Ok();
}

DiskTier::DiskTier(std::shared_ptr<Backend> backend, std::string directory)
    : backend_(std::move(backend)), directory_(std::move(directory)) {}

DiskTier::~DiskTier() = default;

void DiskTier::note(std::string text) {
  std::lock_guard<std::mutex> lock(notices_mu_);
  notices_.push_back(std::move(text));
}

std::vector<std::string> DiskTier::take_notices() {
  std::lock_guard<std::mutex> lock(notices_mu_);
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
}

int DiskTier::open_file(const std::string& path, int flags) {
  flags |= O_CLOEXEC;
#ifdef O_DIRECT
  if (direct_.load()) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
    if (fd >= 0 || errno != EINVAL) return fd;
    if (direct_.exchange(false)) {
      note(directory_ + " does not take O_DIRECT; disk backups there go through the page cache");
    }
    flags &= ~O_EXCL;  // the refused open may have created the file
  }
#endif
  return ::open(path.c_str(), flags, 0600);
}

Status DiskTier::create(const DiskRange& range, std::shared_ptr<DiskFile>* file) {
  const std::string path = directory_ + "/" + disk_file_name(range.tag, range.device, range.va);
  int fd = -1;
  for (;;) {
    fd = open_file(path, O_RDWR | O_CREAT | O_EXCL);
    if (fd < 0) return Status::Error(Code::kHostError, os_error(errno) + ": " + quoted(path));
    if (hold_file(fd)) break;
    close(fd);  // a cleaner took it for stale before it was held
  }
  *file = std::make_shared<DiskFile>(path, fd, range.size);  // from here on removed when dropped
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(range.size));  // a full disk fails here
  if (err != 0) return Status::Error(Code::kHostError, os_error(err));
  return Status::Ok();
}

Status DiskTier::save(const std::vector<DiskRange>& ranges, const DiskSettings& settings, BackupTiers& tiers,
                      std::vector<std::shared_ptr<DiskFile>>* files) {
  files->clear();
  Status s = status_of([&] {
    std::vector<int> fds;
    for (const auto& range : ranges) {
      files->emplace_back();
      Status r = create(range, &files->back());
      if (!r.ok()) return r;
      fds.push_back(files->back()->fd());
    }
    return transfer(ranges, fds, true, settings, tiers, nullptr);
  });
  if (s.ok()) return s;
  files->clear();  // removes them
  if (s.code == Code::kOutOfMemory) return s;  // no staging memory: the budget's words stand
  return Status::Error(s.code, "disk backup of " + describe(ranges) + " to " + quoted(directory_) + " failed: " +
                                   s.message() + "; the tag stays resident with its content");
}

Status DiskTier::load(const std::vector<DiskRange>& ranges, const std::vector<DiskFile*>& files,
                      const DiskSettings& settings, BackupTiers& tiers, const std::vector<HostBuffer>* lent) {
  std::vector<int> fds;
  for (const DiskFile* file : files) fds.push_back(file->fd());
  Status s = status_of([&] { return transfer(ranges, fds, false, settings, tiers, lent); });
  if (s.ok() || s.code == Code::kOutOfMemory) return s;
  return Status::Error(s.code, "reading the disk backup of " + describe(ranges) + " from " + quoted(directory_) +
                                   " failed: " + s.message() + "; the tag stays paused with its backup, call resume "
                                                             "again");
}

Status DiskTier::transfer(const std::vector<DiskRange>& ranges, const std::vector<int>& fds, bool to_disk,
                          const DiskSettings& settings, BackupTiers& tiers, const std::vector<HostBuffer>* lent) {
  struct Piece {
    size_t range, offset, size;
  };
  size_t chunk = std::max<size_t>(kAlignment, settings.chunk_bytes / kAlignment * kAlignment);
  size_t total = 0;
  for (const DiskRange& r : ranges) total += r.size;
  if (total == 0) return Status::Ok();
  // The staging buffers: one chunk a worker, host memory of the tiers (the pool's, else
  // fresh from the node's budget); fewer workers, then smaller chunks (down to 1 MiB), when
  // the budget cannot give that much.
  constexpr size_t kSmallestChunk = 1 << 20;
  size_t largest = 0;
  for (const DiskRange& r : ranges) largest = std::max(largest, r.size);
  chunk = std::min(chunk, (largest + kAlignment - 1) / kAlignment * kAlignment);  // no bigger than a file
  size_t workers = std::max<size_t>(1, std::min(settings.workers, (total + chunk - 1) / chunk));
  std::vector<HostBuffer> staging;
  if (lent) {
    // The lender's buffers: as many workers as there are, each chunk the smallest of them.
    for (const HostBuffer& b : *lent) {
      if (b.size >= kAlignment && staging.size() < std::max<size_t>(1, settings.workers)) staging.push_back(b);
    }
    if (staging.empty()) return Status::Error(Code::kOutOfMemory, "no staging memory for the disk backup");
    for (const HostBuffer& b : staging) chunk = std::min(chunk, b.size / kAlignment * kAlignment);
    workers = staging.size();
  }
  for (; !lent;) {
    // The pool's memory first (it goes back there, the pool no bigger than before); the rest
    // fresh and never pooled: freed, out of the budget, as soon as the transfer ends.
    staging.assign(workers, HostBuffer());
    tiers.pool().take(ranges[0].device, std::vector<size_t>(workers, chunk), &staging);
    std::vector<CopyRequest> requests(workers);
    for (size_t k = 0; k < workers; ++k) {
      requests[k].device = ranges[0].device, requests[k].bytes = chunk, requests[k].cacheable = false;
      requests[k].tier = staging[k] ? Tier::kNone : Tier::kHost;
    }
    Status s = tiers.host_memory(requests, true, &staging);
    if (s.ok()) break;
    if (s.code == Code::kOutOfMemory && workers > 1) {
      workers /= 2;
    } else if (s.code == Code::kOutOfMemory && chunk > kSmallestChunk) {
      chunk = std::max(kSmallestChunk, chunk / 2 / kAlignment * kAlignment);
    } else {
      s.set_message("staging memory for the disk backup (" + std::to_string(workers) + " x " + format_bytes(chunk) +
                    "): " + s.message());
      return s;
    }
  }
  std::vector<Piece> pieces;
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (size_t at = 0; at < ranges[i].size; at += chunk) pieces.push_back({i, at, std::min(chunk, ranges[i].size - at)});
  }
  // Their workers fault the pages in by writing them: no read from the disk may land first.
  std::set<HostArena*> arenas;
  for (const HostBuffer& buffer : staging) arenas.insert(buffer.arena.get());
  for (HostArena* arena : arenas) arena->wait_prepared();
  std::atomic<size_t> next{0};
  std::mutex error_mu;
  Status error;
  std::atomic<bool> failed{false};
  auto work = [&](size_t k) {
    const HostBuffer& buffer = staging[k];
    for (size_t i = next++; i < pieces.size() && !failed.load(); i = next++) {
      const Piece& p = pieces[i];
      const DiskRange& r = ranges[p.range];
      Status s = status_of([&] {
        Status t;
        if (!to_disk) t = read_all(fds[p.range], buffer.data(), p.size, p.offset);
        if (t.ok()) {
          t = buffer.for_each_part(0, p.size, [&](char* host, size_t at, size_t n) {
            return to_disk ? backend_->copy_to_host_async(r.device, host, r.va + p.offset + at, n)
                           : backend_->copy_from_host_async(r.device, r.va + p.offset + at, host, n);
          });
        }
        CopyMark mark = 0;
        if (t.ok()) t = backend_->mark_copies(r.device, &mark);
        if (t.ok()) t = backend_->wait_copy_mark(r.device, mark);  // this worker's copies landed
        if (t.ok() && to_disk) t = write_all(fds[p.range], buffer.data(), p.size, p.offset);
        return t;
      });
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!failed.exchange(true)) error = s;
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t k = 1; k < workers; ++k) {
    try {
      threads.emplace_back(work, k);
    } catch (const std::system_error&) {
      break;  // a thread limit: fewer workers
    }
  }
  work(0);
  for (auto& t : threads) t.join();
  // Fresh staging leaves the budget now, not once the foreground is quiet: the pause that
  // called goes on to take host memory for its other copies.
  HostPool::FreeNow now(tiers.pool());
  staging.clear();
  return error;
}

}  // namespace tmsl
