#include "node_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "node_ledger.h"

namespace tmsl {
namespace {

// Whether the open file `fd` is still the one named `path` (not removed, not replaced).
bool still_named(int fd, const std::string& path) {
  struct stat open_file {}, named {};
  return fstat(fd, &open_file) == 0 && open_file.st_nlink > 0 && stat(path.c_str(), &named) == 0 &&
         named.st_ino == open_file.st_ino && named.st_dev == open_file.st_dev;
}

// Removes the chunk open at `fd` if no other process holds it. Closes fd.
void remove_if_unheld(int fd, const std::string& path) {
  // Converting a shared lock is not atomic, and a refusal leaves none: fd is closed anyway.
  if (flock(fd, LOCK_EX | LOCK_NB) == 0 && !path.empty() && still_named(fd, path)) unlink(path.c_str());
  close(fd);
}

// The store's directory, made if missing, and trusted only if it is this user's and nobody
// else may write it (/dev/shm is everybody's: another user could plant chunks).
Status trusted_directory(const std::string& directory) {
  if (mkdir(directory.c_str(), 0700) != 0 && errno != EEXIST) {
    return errno_status("making the shared backup store " + directory, errno);
  }
  struct stat st {};
  if (lstat(directory.c_str(), &st) != 0) return errno_status("reading the shared backup store " + directory, errno);
  if (!S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022) != 0) {
    return Status::Error(Code::kHostError, "the shared backup store " + directory +
                                               " is not a directory of this user that only it may write; "
                                               "backups are not shared");
  }
  return Status::Ok();
}

// A shared lock without waiting long: one held exclusively is being removed by its last holder.
bool shared_lock(int fd) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    if (flock(fd, LOCK_SH | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK && errno != EINTR) return false;
    usleep(1000);
  }
  return false;
}

class HeldChunks;
HeldChunks& held();

// The chunks this process holds: at exit each is removed if nobody else holds it (the
// process-wide saver is never destroyed, and its backups' chunks would stay in memory).
class HeldChunks {
 public:
  void add(int fd, const std::string& path) {
    static const bool registered = std::atexit([] { held().remove_all_unheld(); }) == 0;
    (void)registered;
    std::lock_guard<std::mutex> lock(mu_);
    paths_[fd] = path;
  }
  // False when it was let go of already (at exit).
  bool remove(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    return paths_.erase(fd) != 0;
  }
  void remove_all_unheld() {
    if (in_forked_child()) return;  // the parent's chunks are the parent's
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : paths_) remove_if_unheld(entry.first, entry.second);
    paths_.clear();
  }

 private:
  std::mutex mu_;
  std::map<int, std::string> paths_;
};

HeldChunks& held() {
  static HeldChunks* chunks = new HeldChunks();  // never destroyed: used at exit
  return *chunks;
}

Status write_all(int fd, const char* data, size_t size) {
  for (size_t done = 0; done < size;) {
    const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return errno_status("writing a shared backup chunk", n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

bool NodeStore::enabled() {
  static const bool on = [] {
    const char* value = getenv("TMSL_SHARE_BACKUPS");
    return value != nullptr && strcmp(value, "1") == 0;
  }();
  return on;
}

std::string NodeStore::directory_for(const std::string& ledger_path) {
  return ledger_path.empty() ? std::string() : ledger_path + ".store";
}

size_t NodeStore::bytes_in(const std::string& directory) {
  DIR* dir = directory.empty() ? nullptr : opendir(directory.c_str());
  if (dir == nullptr) return 0;
  size_t bytes = 0;
  while (const dirent* entry = readdir(dir)) {
    struct stat st {};
    if (entry->d_name[0] != '.' && fstatat(dirfd(dir), entry->d_name, &st, 0) == 0 && S_ISREG(st.st_mode)) {
      bytes += static_cast<size_t>(st.st_size);
    }
  }
  closedir(dir);
  return bytes;
}

uint64_t content_hash(const char* data, size_t size) {
  // Four independent lanes over 8-byte words (the loads and multiplies overlap), then mixed.
  constexpr uint64_t kPrime = 0x9E3779B97F4A7C15ULL;
  uint64_t lane[4] = {size, ~size, kPrime, 0};
  size_t at = 0;
  for (; at + 32 <= size; at += 32) {
    for (int i = 0; i < 4; ++i) {
      uint64_t word;
      memcpy(&word, data + at + 8 * i, 8);
      lane[i] = (lane[i] ^ word) * kPrime;
      lane[i] ^= lane[i] >> 29;
    }
  }
  uint64_t h = lane[0] ^ (lane[1] * 3) ^ (lane[2] * 5) ^ (lane[3] * 7);
  for (; at < size; ++at) h = (h ^ static_cast<unsigned char>(data[at])) * kPrime;
  h ^= h >> 31;
  h *= kPrime;
  return h ^ (h >> 29);
}

Status NodeStore::share(const char* data, size_t size, int* fd, std::string* chunk_path) {
  const std::string directory = directory_for(NodeLedger::instance().path());
  if (directory.empty()) return Status::Error(Code::kHostError, "no host-memory ledger: backups are not shared");
  Status trusted = trusted_directory(directory);
  if (!trusted.ok()) return trusted;
  char name[64];
  snprintf(name, sizeof(name), "%016llx-%zu", static_cast<unsigned long long>(content_hash(data, size)), size);
  const std::string path = directory + "/" + name;
  for (int attempt = 0; attempt < 8; ++attempt) {
    int chunk = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (chunk >= 0) {
      struct stat st {};
      if (!shared_lock(chunk) || fstat(chunk, &st) != 0) {  // held exclusively: being removed
        close(chunk);
        continue;
      }
      if (st.st_nlink == 0) {  // removed by its last holder meanwhile: look again
        close(chunk);
        continue;
      }
      if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 0222) != 0) {
        close(chunk);  // not one of ours, or writable: never trusted with a backup
        return Status::Error(Code::kHostError, "the shared backup chunk " + path + " is not this user's read-only file");
      }
      void* mapped = st.st_size == static_cast<off_t>(size)
                         ? mmap(nullptr, size, PROT_READ, MAP_SHARED, chunk, 0) : MAP_FAILED;
      const bool same = mapped != MAP_FAILED && memcmp(mapped, data, size) == 0;
      if (mapped != MAP_FAILED) munmap(mapped, size);
      if (same) {
        *fd = chunk;
        *chunk_path = path;
        held().add(chunk, path);
        return Status::Ok();
      }
      close(chunk);
      return Status::Error(Code::kHostError, "the shared backup chunk " + path + " holds other bytes");
    }
    if (errno != ENOENT) return errno_status("opening the shared backup chunk " + path, errno);
    // A new chunk: its bytes are the node's budget's while it is being made, and the store's
    // (which the ledger counts) once it has its name.
    Status s = NodeLedger::instance().reserve(size);
    if (!s.ok()) return s;
    chunk = open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (chunk < 0) {
      const int error = errno;
      NodeLedger::instance().give_back(size);
      return errno_status("making a shared backup chunk in " + directory, error);
    }
    s = ftruncate(chunk, static_cast<off_t>(size)) == 0 ? write_all(chunk, data, size)
                                                          : errno_status("sizing a shared backup chunk", errno);
    if (s.ok() && fchmod(chunk, 0400) != 0) s = errno_status("making a shared backup chunk read-only", errno);
    if (s.ok() && flock(chunk, LOCK_SH) != 0) s = errno_status("holding a shared backup chunk", errno);
    char link[64];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", chunk);
    const bool named = s.ok() && linkat(AT_FDCWD, link, AT_FDCWD, path.c_str(), AT_SYMLINK_FOLLOW) == 0;
    const int error = errno;
    NodeLedger::instance().give_back(size);
    if (named) {
      *fd = chunk;
      *chunk_path = path;
      held().add(chunk, path);
      return Status::Ok();
    }
    close(chunk);
    if (!s.ok()) return s;
    if (error != EEXIST) return errno_status("naming the shared backup chunk " + path, error);
    // Another process published the same bytes first: take theirs.
  }
  return Status::Error(Code::kHostError, "the shared backup chunk " + path + " kept changing; kept a private copy");
}

void NodeStore::release(int fd, const std::string& path) {
  if (held().remove(fd)) remove_if_unheld(fd, path);
}

void NodeStore::collect_garbage(const std::string& directory) {
  struct stat st {};
  if (directory.empty() || lstat(directory.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) {
    return;  // none, or not this user's to clean
  }
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int chunk = openat(dirfd(dir), entry->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (chunk >= 0) remove_if_unheld(chunk, directory + "/" + entry->d_name);
  }
  closedir(dir);
}

}  // namespace tmsl
