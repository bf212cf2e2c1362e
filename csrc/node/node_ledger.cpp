#include "node/node_ledger.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>

#include "node/host_limits.h"
#include "node/process_identity.h"

namespace tmsl {

namespace {

constexpr uint64_t kMagic = 0x746d736c6c656432ULL;  // "tmslled2": the layout below
constexpr size_t kSlots = 1024;                      // processes of one node at once

// The layout's version is in the name: processes of different library versions each keep a
// ledger of their own rather than misread one another's.
std::string default_path() {
  return "/dev/shm/torch_mem_saver_lite-" + std::to_string(getuid()) + ".v2.ledger";
}

}  // namespace

// A process owns its slot while it holds its record lock on the slot's bytes
// (process_identity.h: the node's one liveness check).
struct NodeLedger::Slot {
  int32_t pid;  // for people reading who holds what; the lock says who is alive
  uint32_t shared_mib;  // MiB of the node's store it maps (counted once, in the store's bytes)
  uint64_t start_time;
  uint64_t held;    // bytes of host memory this process's backups and cache hold
  uint64_t cached;  // of which its host cache, which it could give back
};

struct NodeLedger::Shared {
  uint64_t magic;     // written last when the file is made: 0 means never finished
  uint64_t budget;    // 0: none
  uint32_t pressure;  // bumped (a futex word) when a process asks the others for room
  uint32_t explicit_budget;  // set by the variable or the API; else the default, renewed when idle
  Slot slots[kSlots];
};

namespace {

// Holds the file's flock for a scope.
class FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) {
    while (flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        error_ = errno;
        return;
      }
    }
    held_ = true;
  }
  ~FileLock() {
    if (held_) flock(fd_, LOCK_UN);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const { return held_; }
  int error() const { return error_; }

 private:
  int fd_;
  bool held_ = false;
  int error_ = 0;
};

}  // namespace

std::string NodeLedger::path_for(const std::string& named) { return named.empty() ? default_path() : named; }

void NodeLedger::leave_after_fork() {
  // In the child, right after fork: the parent's slot and its flock stay the parent's.
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

NodeLedger::NodeLedger(const Settings& settings, SharedHoldings* held_once)
    : owner_(getpid()), start_time_(process_start_time(getpid())), path_(settings.path), held_once_(held_once) {
  budget_applies_.store(settings.budget_applies);
  // Counted whether or not this process shares: another process of the node may.
  if (held_once_ != nullptr) held_once_->collect_garbage();  // chunks of processes that died
  if (!settings.budget_error.empty()) {
    error_ = settings.budget_error + "; no budget applies";
    return;
  }
  const size_t budget_from_env = settings.budget;
  fd_ = open_private(&error_);
  if (fd_ < 0) return;
  Status opened = status_of([&] {  // open_shared says what went wrong in error_
    open_shared(budget_from_env);
    return Status::Ok();
  });
  if (!opened.ok()) error_ = opened.message() + "; no budget applies";
  if (shared_ == nullptr) {
    close(fd_);
    fd_ = -1;
    return;
  }
  // The ledger opens where a saver is made: from here on the node's other processes see this
  // one, and a pause of theirs is not alone (alone_on_node()).
  joined_ = true;
  locked([&] {
    my_slot();
    return Status::Ok();
  });
}

NodeLedger::~NodeLedger() = default;

int NodeLedger::open_private(std::string* why) const {
  // O_NOFOLLOW: a link planted at the path is refused, nothing made where it points.
  const int fd = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
  if (fd < 0) {
    *why = "cannot open the host-memory ledger " + path_ + ": " + strerror(errno) +
           (errno == ELOOP ? " (a symbolic link, not followed: remove it)" : "") + "; no budget applies";
    return -1;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !private_to_this_user(st)) {
    char mode[8];
    snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *why = "the host-memory ledger " + path_ + " is not a regular file of this user that nobody else may write (owner uid " +
           std::to_string(st.st_uid) + ", mode " + mode + "): another user could change the budget; remove it; no budget applies";
    close(fd);
    return -1;
  }
  return fd;
}

void NodeLedger::open_shared(size_t budget_from_env) {
  FileLock lock(fd_);
  if (!lock.held()) {
    error_ = "cannot lock the host-memory ledger " + path_ + ": " + strerror(lock.error()) + "; no budget applies";
    return;
  }
  image_.reset(new Shared());
  shared_ = image_.get();
  Status s = load();
  if (s.ok()) {
    if (budget_from_env != 0) {
      shared_->budget = budget_from_env;
      shared_->explicit_budget = 1;
    } else if (shared_->explicit_budget == 0 && (shared_->budget == 0 || nobody_alive())) {
      shared_->budget = host_memory_limit() / 2;  // renewed while no process holds a share
    }
    s = store();
  }
  void* word = s.ok() ? mmap(nullptr, sizeof(uint32_t), PROT_READ, MAP_SHARED, fd_, 0) : MAP_FAILED;
  if (s.ok() && word == MAP_FAILED) s = errno_status("mapping the host-memory ledger " + path_, errno);
  if (!s.ok()) {
    error_ = s.message() + "; no budget applies";
    shared_ = nullptr;
    return;
  }
  // Only the kernel reads it (futex calls): a file cut short makes those fail, never a SIGBUS.
  pressure_word_.store(reinterpret_cast<uint32_t*>(static_cast<char*>(word) + offsetof(Shared, pressure)));
}

Status NodeLedger::load() {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return errno_status("reading the host-memory ledger " + path_, errno);
  const size_t size = static_cast<size_t>(st.st_size);
  uint64_t magic = 0;
  if (size >= sizeof(magic) && pread(fd_, &magic, sizeof(magic), 0) != static_cast<ssize_t>(sizeof(magic))) {
    return errno_status("reading the host-memory ledger " + path_, errno);
  }
  // Cut short: made whole if it is this ledger (its mark, or the file this process read before).
  if (size > sizeof(Shared) || (size != 0 && size < sizeof(Shared) && magic != kMagic && !loaded_)) {
    return Status::Error(Code::kHostError,
                         path_ + " is not a host-memory ledger of this version; remove it once no process uses it");
  }
  if (size < sizeof(Shared) && ftruncate(fd_, sizeof(Shared)) != 0) {
    return errno_status("sizing the host-memory ledger " + path_, errno);
  }
  if (pread(fd_, shared_, sizeof(Shared), 0) != static_cast<ssize_t>(sizeof(Shared))) {
    return errno_status("reading the host-memory ledger " + path_, errno);
  }
  if (shared_->magic == 0) {  // new, cut to nothing, or its maker died before finishing it
    std::memset(shared_, 0, sizeof(Shared));
    shared_->magic = kMagic;
    shared_->budget = budget_seen_;
    shared_->explicit_budget = explicit_seen_;
  } else if (shared_->magic != kMagic) {
    return Status::Error(Code::kHostError, path_ + " is not a host-memory ledger; remove it once no process uses it");
  }
  if (explicit_seen_ != 0 && shared_->explicit_budget == 0) {  // a file made again: the budget set stays
    shared_->budget = budget_seen_;
    shared_->explicit_budget = 1;
  }
  loaded_ = true;
  // This process's entry, from what it knows: a file cut short or made again lost it.
  if (slot_ < 0 && (joined_ || my_held_ != 0 || my_shared_mib_ != 0)) my_slot();
  if (slot_ >= 0) shared_->slots[slot_] = Slot{owner_, my_shared_mib_, start_time_, my_held_, my_cached_};
  return Status::Ok();
}

Status NodeLedger::store() {
  if (slot_ >= 0) {
    my_held_ = shared_->slots[slot_].held;
    my_cached_ = shared_->slots[slot_].cached;
    my_shared_mib_ = shared_->slots[slot_].shared_mib;
  }
  budget_seen_ = shared_->budget;
  explicit_seen_ = shared_->explicit_budget;
  if (pwrite(fd_, shared_, sizeof(Shared), 0) != static_cast<ssize_t>(sizeof(Shared))) {
    return errno_status("writing the host-memory ledger " + path_, errno);
  }
  return Status::Ok();
}

bool NodeLedger::stale() const {
  struct stat held {}, named {};
  if (fd_ < 0 || fstat(fd_, &held) != 0) return false;
  if (static_cast<size_t>(held.st_size) != sizeof(Shared)) return true;
  if (lstat(path_.c_str(), &named) != 0) return errno == ENOENT;
  return named.st_dev != held.st_dev || named.st_ino != held.st_ino;
}

void NodeLedger::follow_path() {
  struct stat held {}, named {};
  if (fstat(fd_, &held) == 0 && lstat(path_.c_str(), &named) == 0 && named.st_dev == held.st_dev &&
      named.st_ino == held.st_ino) {
    return;  // the same file (cut short: load() makes it whole)
  }
  std::string why;
  const int fd = open_private(&why);
  if (fd < 0) return;  // nothing trusted there: this process keeps to the file it has
  void* word = mmap(nullptr, sizeof(uint32_t), PROT_READ, MAP_SHARED, fd, 0);
  if (word == MAP_FAILED) {
    close(fd);
    return;
  }
  close(fd_);  // its flock and this process's record lock go with it
  fd_ = fd;
  slot_ = -1;  // load() takes one in this file and publishes what this process holds
  loaded_ = false;
  uint32_t* old = pressure_word_.exchange(reinterpret_cast<uint32_t*>(static_cast<char*>(word) + offsetof(Shared, pressure)));
  // A watcher waiting on the old word sees EFAULT at worst, never a SIGBUS (it never reads it).
  munmap(reinterpret_cast<char*>(old) - offsetof(Shared, pressure), sizeof(uint32_t));
}

template <typename Body>
Status NodeLedger::locked(Body&& body) {
  if (shared_ == nullptr || getpid() != owner_) return Status::Ok();  // no ledger, or a forked child's copy
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return Status::Ok();
  if (stale()) follow_path();
  FileLock file(fd_);
  if (!file.held()) return errno_status("locking the host-memory ledger " + path_, file.error());
  Status loaded = load();
  if (!loaded.ok()) return loaded;
  Status done = status_of([&] { return body(); });
  Status stored = store();
  return done.ok() ? stored : done;
}

bool NodeLedger::alive(size_t index) const {
  return range_held(fd_, static_cast<off_t>(offsetof(Shared, slots) + index * sizeof(Slot)), sizeof(Slot));
}

bool NodeLedger::nobody_alive() const {
  for (size_t i = 0; i < kSlots; ++i) {
    if (shared_->slots[i].pid != 0 && alive(i)) return false;
  }
  return true;
}

bool NodeLedger::others_alive() const {
  for (size_t i = 0; i < kSlots; ++i) {
    if (static_cast<int>(i) != slot_ && shared_->slots[i].pid != 0 && alive(i)) return true;
  }
  return false;
}

NodeLedger::Slot* NodeLedger::my_slot() {
  if (slot_ >= 0) return &shared_->slots[slot_];
  forget_dead_processes();
  for (size_t i = 0; i < kSlots; ++i) {
    if (shared_->slots[i].pid != 0) continue;
    if (!claim_range(fd_, static_cast<off_t>(offsetof(Shared, slots) + i * sizeof(Slot)), sizeof(Slot))) {
      continue;  // still someone's, or no lock to be had
    }
    shared_->slots[i] = Slot{owner_, 0, start_time_, 0, 0};
    slot_ = static_cast<int>(i);
    return &shared_->slots[i];
  }
  return nullptr;
}

void NodeLedger::forget_dead_processes() {
  for (size_t i = 0; i < kSlots; ++i) {
    if (static_cast<int>(i) == slot_ || shared_->slots[i].pid == 0) continue;
    if (!alive(i)) shared_->slots[i] = Slot{};  // gone, its memory with it
  }
}

size_t NodeLedger::total_held() const {
  size_t total = held_once_ != nullptr ? held_once_->bytes() : 0;  // 0 where no process of the node shares
  for (const Slot& slot : shared_->slots) total += slot.held;
  return total;
}

std::string NodeLedger::holders_text() const {
  std::string text;
  for (const Slot& slot : shared_->slots) {
    if (slot.pid == 0 || slot.held == 0) continue;
    text += std::string(text.empty() ? "" : ", ") + "pid " + std::to_string(slot.pid) +
            (slot_ >= 0 && &slot == &shared_->slots[slot_] ? " (this process)" : "") + " " + format_bytes(slot.held) +
            (slot.cached != 0 ? " (" + format_bytes(slot.cached) + " of it cache)" : "");
  }
  const size_t shared = held_once_ != nullptr ? held_once_->bytes() : 0;
  if (shared != 0) text += std::string(text.empty() ? "" : ", ") + "the shared backup store " + format_bytes(shared);
  return text.empty() ? "nobody" : text;
}

Status NodeLedger::reserve(size_t bytes) {
  Status reserved = locked([&] {
    Slot* mine = my_slot();
    if (mine == nullptr) {
      return Status::Error(Code::kHostError, "the host-memory ledger " + path_ + " has no room for another process");
    }
    const size_t budget = budget_applies_.load() ? shared_->budget : 0;
    if (budget != 0 && total_held() + bytes > budget) {
      forget_dead_processes();
      if (held_once_ != nullptr) held_once_->collect_garbage();  // chunks of processes that died
      if (total_held() + bytes > budget) {
        return Status::Error(
            Code::kOutOfMemory,
            "the node's host-memory budget of " + format_bytes(budget) + " has " +
                format_bytes(budget - std::min(budget, total_held())) + " left, " + format_bytes(bytes) +
                " needed; held by " + holders_text() +
                " (raise it with TMSL_HOST_MEMORY_BUDGET or saver.host_memory_budget, or give host memory "
                "back: release_host_cache(), fewer backed-up tags)");
      }
    }
    mine->held += bytes;
    return Status::Ok();
  });
  if (reserved.ok() && bytes != 0) watch_in_background();  // what it holds is watched over
  return reserved;
}

void NodeLedger::give_back(size_t bytes) {
  locked([&] {
    Slot* mine = my_slot();
    if (mine != nullptr) {
      mine->held -= std::min<uint64_t>(mine->held, bytes);
      mine->cached = std::min(mine->cached, mine->held);
    }
    return Status::Ok();
  });
}

namespace {
// Sets owner's figure (0 removes it) and returns the figures' sum: the process's.
size_t set_figure(std::map<const void*, size_t>* per_owner, const void* owner, size_t bytes) {
  if (bytes == 0) {
    per_owner->erase(owner);
  } else {
    (*per_owner)[owner] = bytes;
  }
  size_t total = 0;
  for (const auto& entry : *per_owner) total += entry.second;
  return total;
}
}  // namespace

void NodeLedger::note_cached(const void* owner, size_t bytes) {
  locked([&] {
    const size_t total = set_figure(&cached_, owner, bytes);
    Slot* mine = my_slot();
    if (mine != nullptr) mine->cached = std::min<uint64_t>(total, mine->held);
    return Status::Ok();
  });
}

void NodeLedger::note_shared(const void* owner, size_t bytes) {
  locked([&] {
    const size_t total = set_figure(&shared_by_, owner, bytes);
    Slot* mine = my_slot();
    if (mine != nullptr) mine->shared_mib = static_cast<uint32_t>(std::min<size_t>(total >> 20, UINT32_MAX));
    return Status::Ok();
  });
}

void NodeLedger::on_pressure(const void* owner, std::function<void()> give_back) {
  {
    std::lock_guard<std::mutex> lock(givers_mu_);
    givers_[owner] = std::move(give_back);
  }
  watch_in_background();
}

void NodeLedger::watch_in_background() {
  std::lock_guard<std::mutex> lock(givers_mu_);
  if (watching_ || shared_ == nullptr || getpid() != owner_) return;
  try {
    std::thread([this] { watch(); }).detach();  // lives as long as the process
    watching_ = true;
  } catch (const std::system_error&) {
    // No thread to be had: caches are given back only by this process's own pauses, and a
    // ledger removed or cut short is noticed at its next update.
  }
}

uint32_t NodeLedger::pressure_now() {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t value = 0;
  if (fd_ >= 0 && pread(fd_, &value, sizeof(value), offsetof(Shared, pressure)) != sizeof(value)) value = 0;
  return value;
}

void NodeLedger::forget(const void* owner) {
  std::lock_guard<std::mutex> lock(givers_mu_);
  givers_.erase(owner);
  {
    std::lock_guard<std::mutex> cached(mu_);
    cached_.erase(owner);
    shared_by_.erase(owner);
  }
}

void NodeLedger::watch() {
  uint32_t seen = pressure_now();
  while (true) {
    // Woken by an asker, or a quarter second on: a ledger removed, replaced or cut short
    // meanwhile gets this process's holdings back (the update does it), so a newcomer sees them.
    const timespec quarter{0, 250 * 1000 * 1000};
    if (syscall(SYS_futex, pressure_word_.load(), FUTEX_WAIT, seen, &quarter, nullptr, 0) != 0 && errno == EFAULT) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));  // the file cut short: made whole below
    }
    bool moved = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      moved = stale();
    }
    if (moved) locked([] { return Status::Ok(); });
    const uint32_t now = pressure_now();
    if (now == seen || getpid() != owner_) continue;
    seen = now;
    std::lock_guard<std::mutex> lock(givers_mu_);
    for (auto& entry : givers_) {
      try {
        entry.second();
      } catch (...) {
        // Out of memory for bookkeeping, say: the cache stays; the asker is refused in time.
      }
    }
  }
}

bool NodeLedger::fits(size_t bytes, size_t* others_cached) {
  bool room = true;
  *others_cached = 0;
  locked([&] {
    forget_dead_processes();
    room = shared_->budget == 0 || !budget_applies_.load() || total_held() + bytes <= shared_->budget;
    for (const Slot& slot : shared_->slots) {
      if (slot.pid != 0 && (slot_ < 0 || &slot != &shared_->slots[slot_])) *others_cached += slot.cached;
    }
    return Status::Ok();
  });
  return room;
}

bool NodeLedger::ask_others_for(size_t bytes, std::chrono::milliseconds patience) {
  if (shared_ == nullptr || getpid() != owner_) return false;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  auto next_ask = std::chrono::steady_clock::now();
  while (true) {
    size_t others_cached = 0;
    if (fits(bytes, &others_cached)) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline || others_cached == 0) return false;  // nobody has a cache left to give
    if (now >= next_ask) {
      // Asked again now and then: a process busy with its own pause skips one request.
      locked([&] {
        ++shared_->pressure;
        return Status::Ok();
      });
      syscall(SYS_futex, pressure_word_.load(), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
      next_ask = now + std::chrono::milliseconds(100);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

size_t NodeLedger::room_with_others_caches() {
  size_t room = SIZE_MAX;
  locked([&] {
    forget_dead_processes();
    if (shared_->budget == 0 || !budget_applies_.load()) return Status::Ok();
    size_t cached = 0;
    for (const Slot& slot : shared_->slots) {
      if (slot.pid != 0 && (slot_ < 0 || &slot != &shared_->slots[slot_])) cached += slot.cached;
    }
    const size_t held = total_held();
    room = (held < shared_->budget ? shared_->budget - held : 0) + cached;
    return Status::Ok();
  });
  return room;
}

NodeLedger::Figures NodeLedger::figures() {
  Figures f;
  f.path = path_;
  f.error = error_;
  Status read = locked([&] {
    f.active = true;
    forget_dead_processes();
    f.budget = shared_->budget;
    for (size_t i = 0; i < kSlots; ++i) {
      const Slot& slot = shared_->slots[i];
      if (slot.pid == 0) continue;
      const bool mine = static_cast<int>(i) == slot_;
      (mine ? f.held_here : f.held_by_others) += slot.held;
      if (slot.held != 0 || slot.shared_mib != 0) {
        f.holders.push_back(Holder{i, slot.pid, slot.held, slot.cached, mine, size_t{slot.shared_mib} << 20});
      }
    }
    f.shared = held_once_ != nullptr ? held_once_->bytes() : 0;
    return Status::Ok();
  });
  if (!read.ok()) f.error = read.message();
  if (f.active && !budget_applies_.load()) {
    f.budget = 0;
    f.error = "no host-memory budget limits this process: TMSL_LIKE_TORCH_MEMORY_SAVER=1, as torch_memory_saver "
              "(TMSL_HOST_MEMORY_BUDGET or saver.host_memory_budget sets one)";
  }
  return f;
}

Status NodeLedger::set_budget(size_t bytes) {
  if (bytes == 0) {
    return Status::Error(Code::kInvalidArgument, "a host-memory budget must be above 0 bytes");
  }
  if (shared_ == nullptr) {
    return Status::Error(Code::kHostError, "no host-memory ledger: " + error_);
  }
  Status s = locked([&] {
    shared_->budget = bytes;
    shared_->explicit_budget = 1;
    return Status::Ok();
  });
  if (s.ok()) budget_applies_.store(true);  // asked for: also where the switch left it without
  return s;
}

bool NodeLedger::alone_on_node() {
  bool others = false;
  // No ledger (or a forked child's copy): nobody to tell apart, so the store is used as before.
  if (shared_ == nullptr || getpid() != owner_) return false;
  Status read = locked([&] {
    others = others_alive();
    return Status::Ok();
  });
  return read.ok() && !others;
}

}  // namespace tmsl
