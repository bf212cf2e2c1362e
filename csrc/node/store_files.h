// The files of the node's store (node_store.h) as every use of them needs them: the store's
// directory opened and trusted, a chunk opened and trusted, names removed only where they still
// lead to the file in hand, locks, names given to unnamed files. Internal to node_store.cpp.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "node/process_identity.h"
#include "platform/status.h"

namespace tmsl {

namespace store_files {

// Chunks taken back for new bytes are renamed so (a name with a dot is never a chunk's): a file
// once named cannot be named again after its last name goes (only an O_TMPFILE can), but it
// can be renamed, so it keeps one until published again.
constexpr const char* kHiddenPrefix = ".recycled-";

// Why a file of the store that is not this user's alone is refused ("" where it is): its owner
// and the permissions others have, in words.
inline std::string foreign_to_this_user(const struct stat& st, mode_t others_may_not) {
  char text[160] = "";
  if (st.st_uid != geteuid()) {
    snprintf(text, sizeof(text), "it is owned by uid %u, not by this process's user (uid %u)",
             static_cast<unsigned>(st.st_uid), static_cast<unsigned>(geteuid()));
  } else if ((st.st_mode & others_may_not) != 0) {
    snprintf(text, sizeof(text), "its mode %04o lets other users %s it", static_cast<unsigned>(st.st_mode & 07777),
             (st.st_mode & others_may_not & 022) != 0 ? "write" : "read");
  }
  return text;
}

// The store's directory, opened and trusted only if it is this user's and nobody else may
// write it, nor read it: /dev/shm is every user's, and another one could plant a store or
// chunks; the chunks' names are their fingerprints, which tell of the key. Every use goes
// through the descriptor, never the path again. -1: none (or not trusted: refusal() says why).
class StoreDirectory {
 public:
  StoreDirectory(const std::string& path, bool create) {
    if (path.empty()) return;
    if (create && mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return;
    fd_ = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st {};
    if (fd_ >= 0 && (fstat(fd_, &st) != 0 || !private_to_this_user(st) || (st.st_mode & 077) != 0)) {
      refusal_ = foreign_to_this_user(st, 077);
      close(fd_);
      fd_ = -1;
    }
  }
  // Why the directory is not trusted ("" where it is, or is missing).
  const std::string& refusal() const { return refusal_; }
  ~StoreDirectory() {
    if (fd_ >= 0) close(fd_);
  }
  StoreDirectory(const StoreDirectory&) = delete;
  StoreDirectory& operator=(const StoreDirectory&) = delete;
  int fd() const { return fd_; }

  // Calls visit(name) for each chunk.
  template <typename Visit>
  void each(Visit&& visit) const {
    each_name([&](const char* name) {
      if (name[0] != '.') visit(name);  // not ".", "..", the key or a claim
    });
  }
  // Calls visit(name) for each claim.
  template <typename Visit>
  void each_claim(Visit&& visit) const {
    each_name([&](const char* name) {
      if (strncmp(name, ".claim-", 7) == 0) visit(name);
    });
  }
  // Calls visit(name) for each chunk taken back for new bytes (hidden meanwhile).
  template <typename Visit>
  void each_hidden(Visit&& visit) const {
    each_name([&](const char* name) {
      if (strncmp(name, kHiddenPrefix, strlen(kHiddenPrefix)) == 0) visit(name);
    });
  }

 private:
  template <typename Visit>
  void each_name(Visit&& visit) const {
    const int listing = fd_ < 0 ? -1 : dup(fd_);
    DIR* dir = listing < 0 ? nullptr : fdopendir(listing);
    if (dir == nullptr) {
      if (listing >= 0) close(listing);
      return;
    }
    rewinddir(dir);
    while (const dirent* entry = readdir(dir)) visit(entry->d_name);
    closedir(dir);
  }

  int fd_ = -1;
  std::string refusal_;
};

// A chunk is trusted only as this user's read-only regular file.
inline bool trusted_chunk(const struct stat& st) {
  return S_ISREG(st.st_mode) && private_to_this_user(st) && (st.st_mode & 0200) == 0;
}

// Opens chunk `name` of the store without following links or blocking (a FIFO planted there
// must not hang anyone); -1 unless it is a trusted chunk.
inline int open_chunk(int directory, const char* name) {
  const int fd = openat(directory, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  struct stat st {};
  if (fd >= 0 && (fstat(fd, &st) != 0 || !trusted_chunk(st))) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether `name` in `directory` still leads to the file open at `fd` (chunks are renamed and
// removed by other processes between opening and locking); the open file's stat in *open_file
// where given.
inline bool names_file(int directory, const char* name, int fd, struct stat* open_file = nullptr) {
  struct stat own {}, named {};
  struct stat& file = open_file != nullptr ? *open_file : own;
  return fstat(fd, &file) == 0 && fstatat(directory, name, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_ino == file.st_ino &&
         named.st_dev == file.st_dev;
}

// Removes chunk `name` (open at `fd`) if no other process holds it. (Converting a shared
// lock is not atomic, and a refusal leaves none: callers are letting the chunk go.)
inline void unlink_if_unheld(int directory, int fd, const char* name) {
  if (flock(fd, LOCK_EX | LOCK_NB) == 0 && names_file(directory, name, fd)) unlinkat(directory, name, 0);
}

// Removes the name `name` if it is still the file open at `fd`'s.
inline void unlink_if_named(int directory, int fd, const char* name) {
  if (names_file(directory, name, fd)) unlinkat(directory, name, 0);
}

// A shared lock without waiting long: one held exclusively is being removed by its last holder.
inline bool shared_lock(int fd) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    if (flock(fd, LOCK_SH | LOCK_NB) == 0) return true;
    if (errno != EWOULDBLOCK && errno != EINTR) return false;
    usleep(1000);
  }
  return false;
}

inline Status write_all(int fd, const char* data, size_t size) {
  for (size_t done = 0; done < size;) {
    const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return errno_status("writing a shared backup chunk", n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Names the unnamed file open at `fd` `name` in `directory`; false with errno where it cannot.
inline bool link_into(int directory, int fd, const char* name) {
  char link[64];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  return linkat(AT_FDCWD, link, directory, name, AT_SYMLINK_FOLLOW) == 0;
}

}  // namespace store_files
}  // namespace tmsl
