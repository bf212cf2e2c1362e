#include "node/node_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <linux/magic.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <mutex>

#include "node/process_identity.h"
#include "node/store_files.h"

namespace tmsl {

using namespace store_files;  // NOLINT: this file's own helpers

namespace {

// The chunks this process holds (descriptor -> path). At exit each is removed if nobody else
// holds it: the process-wide saver is never destroyed, and its chunks would stay in memory.
// A forked child closes its copies at once: they would keep the parent's chunks alive.
class HeldChunks {
 public:
  HeldChunks() {
    std::atexit([] { instance().let_go_all(); });
    // The map is locked across a fork, so the child finds it whole.
    pthread_atfork([] { instance().mu_.lock(); }, [] { instance().mu_.unlock(); },
                   [] { instance().forget_in_child(); });
  }
  static HeldChunks& instance() {
    static HeldChunks* chunks = new HeldChunks();  // never destroyed: used at exit
    return *chunks;
  }
  // Whether this process holds the chunk at `path` (or claims it: `claim`).
  bool holds(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : paths_) {
      if (entry.second == path) return true;
    }
    return false;
  }
  // Whether the file at `path` is one this process holds, named or hidden: never opened here
  // again, since closing that descriptor would drop the record lock its holder vouches with.
  bool holds_file(const std::string& path) {
    if (holds(path)) return true;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : hidden_) {
      if (entry.second == path) return true;
    }
    return false;
  }
  bool claims(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return claims_.count(name) != 0;
  }
  // The descriptors of new chunks not yet named and of claims: a forked child closes its
  // copies of them too (they would keep a parent's chunk memory, or its claims, alive).
  void note_unnamed(int fd, bool held) {
    std::lock_guard<std::mutex> lock(mu_);
    if (held) {
      unnamed_.insert(fd);
    } else {
      unnamed_.erase(fd);
    }
  }
  void note_claim(const std::string& name, bool held) {
    std::lock_guard<std::mutex> lock(mu_);
    if (held) {
      claims_.insert(name);
    } else {
      claims_.erase(name);
    }
  }
  // False once the process is exiting: the caller lets the chunk go itself.
  bool add(int fd, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    if (exiting_) return false;
    paths_[fd] = path;
    return true;
  }
  // The chunk's path, taken off the list; false when it was let go of already (at exit).
  // A chunk taken back (take_back): off the list of named ones, unnamed (a forked child closes
  // it), under a hidden name until published again (fd -> path); in one step.
  void hide(int fd, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.erase(fd);
    unnamed_.insert(fd);
    hidden_[fd] = path;
  }
  void note_hidden_gone(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    hidden_.erase(fd);
  }
  bool hidden_path(int fd, std::string* path) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = hidden_.find(fd);
    if (it == hidden_.end()) return false;
    *path = it->second;
    return true;
  }
  // The chunk's path, still on the list; false where fd is none of its chunks.
  bool path_of(int fd, std::string* path) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = paths_.find(fd);
    if (it == paths_.end()) return false;
    *path = it->second;
    return true;
  }
  bool take(int fd, std::string* path) {
    if (in_forked_child()) return false;  // closed when the child started
    std::lock_guard<std::mutex> lock(mu_);
    auto it = paths_.find(fd);
    if (it == paths_.end()) return false;
    *path = std::move(it->second);
    paths_.erase(it);
    return true;
  }

 private:
  // At exit: each chunk nobody else holds is removed; the descriptors are left to the kernel
  // (a background thread may still be using one), and nobody closes them from now on.
  void let_go_all() {
    if (in_forked_child()) return;
    std::lock_guard<std::mutex> lock(mu_);
    exiting_ = true;
    for (const auto& entry : paths_) with_directory(entry.second, [&](int directory, const char* name) {
      unlink_if_unheld(directory, entry.first, name);
    });
    for (const auto& entry : hidden_) with_directory(entry.second, [&](int directory, const char* name) {
      unlink_if_named(directory, entry.first, name);
    });
    paths_.clear();
    hidden_.clear();
  }
  // In a forked child (the map locked by the fork): its copies of the descriptors closed.
  void forget_in_child() {
    for (const auto& entry : paths_) close(entry.first);
    for (int fd : unnamed_) close(fd);
    paths_.clear();
    unnamed_.clear();
    hidden_.clear();  // (their descriptors are among unnamed_)
    mu_.unlock();
  }

  std::mutex mu_;
  std::map<int, std::string> paths_;
  std::set<std::string> claims_;  // the names of the claims this process holds
  std::set<int> unnamed_;         // descriptors of unnamed new chunks and of claims
  std::map<int, std::string> hidden_;  // chunks taken back, under a hidden name meanwhile
  bool exiting_ = false;

 public:
  // Removes the chunk if nobody else holds it, and closes fd.
  static void let_go(int fd, const std::string& path) {
    with_directory(path, [&](int directory, const char* name) { unlink_if_unheld(directory, fd, name); });
    close(fd);
  }
  // Calls use(directory fd, name) for a chunk's path, if its directory is trusted.
  template <typename Use>
  static void with_directory(const std::string& path, Use&& use) {
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return;
    StoreDirectory directory(path.substr(0, slash), false);
    if (directory.fd() >= 0) use(directory.fd(), path.c_str() + slash + 1);
  }
};

}  // namespace

namespace {

// What the store refused and why, each told once per process: a refusal means private copies
// (as with sharing off), which the user should hear of once, not at every pause.
class Notices {
 public:
  static Notices& instance() {
    static Notices* notices = new Notices();  // never destroyed: told from background threads
    return *notices;
  }
  void tell(const std::string& what, const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    if (told_.insert(what).second) pending_.push_back(text);
    waiting_ = pending_.size();
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> taken;
    taken.swap(pending_);
    waiting_ = 0;
    return taken;
  }
  size_t waiting() const { return waiting_.load(); }  // (no lock: asked after every pause)

 private:
  std::mutex mu_;
  std::set<std::string> told_;  // what was told (a path and why), ever
  std::vector<std::string> pending_;
  std::atomic<size_t> waiting_{0};  // pending_.size()
};

// `what` names the refusal (told once); `text` says it, and what to do.
void tell(const std::string& what, const std::string& text) { Notices::instance().tell(what, text); }

// A chunk trusted is held with a shared record lock of its first byte besides its flock: what
// another process of this PID namespace checks (process_identity.h) before trusting it in turn.
constexpr off_t kVouchStart = 0, kVouchLength = 1;

constexpr const char* kPrivateCopies = "backups it would hold are private copies, as with TMSL_SHARE_BACKUPS=0";

}  // namespace

std::vector<std::string> NodeStore::take_notices() { return Notices::instance().take(); }

size_t NodeStore::notices_waiting() { return Notices::instance().waiting(); }

NodeStore::NodeStore(std::string directory, bool stores_when_alone)
    : directory_(std::move(directory)), stores_when_alone_(stores_when_alone) {}

std::string NodeStore::directory_for(const std::string& ledger_path) {
  return ledger_path.empty() ? std::string() : ledger_path + ".store";
}

size_t NodeStore::bytes() {
  const std::string& path = directory_;
  StoreDirectory directory(path, false);
  size_t bytes = 0;
  directory.each([&](const char* name) {
    struct stat st {};
    // The memory a trusted chunk takes (a sparse file planted there takes none).
    if (fstatat(directory.fd(), name, &st, AT_SYMLINK_NOFOLLOW) == 0 && trusted_chunk(st)) {
      bytes += static_cast<size_t>(st.st_blocks) * 512;
    }
  });
  return bytes;
}

namespace {

constexpr const char* kKeyName = ".key";

std::string claim_name(const Fingerprint& f) { return ".claim-" + f.name(); }

// Reads the key file open at `fd`: trusted as a chunk is, and read by nobody else (whoever
// reads it can make bytes whose fingerprint is another's at will: the fingerprint's strength
// is the key's secrecy).
Status read_key(const std::string& path, int fd, FingerprintKey* out) {
  struct stat st {};
  const bool read = fstat(fd, &st) == 0;
  const std::string foreign = read ? foreign_to_this_user(st, 077) : std::string();
  if (!foreign.empty()) {
    const std::string message = "the shared backup store's key " + path + "/" + kKeyName + " is not trusted: " +
                                foreign + ", and whoever can read it can make chunks that pass for other bytes; " +
                                kPrivateCopies + ". Remove the store (rm -r " + path +
                                ") once no process of the node uses it: the next one draws a new key, readable by "
                                "this user alone";
    tell("key:" + path, message);
    return Status::Error(Code::kHostError, message);
  }
  if (!read || !trusted_chunk(st) || st.st_size != static_cast<off_t>(sizeof(FingerprintKey))) {
    return Status::Error(Code::kHostError, "the shared backup store's key is not this user's read-only key file");
  }
  FingerprintKey key;
  if (pread(fd, &key, sizeof(key), 0) != static_cast<ssize_t>(sizeof(key)) || !key.valid()) {
    return Status::Error(Code::kHostError, "the shared backup store's key cannot be read");
  }
  *out = key;
  return Status::Ok();
}


Status untrusted_store(const std::string& path, const StoreDirectory& directory) {
  if (directory.refusal().empty()) {  // (missing, say: nothing planted to tell of)
    return Status::Error(Code::kHostError, "the shared backup store " + path +
                                               " is not a directory of this user that only it may read and write");
  }
  const std::string message = "the shared backup store " + path + " is not trusted: " + directory.refusal() +
                              " (another user could plant chunks there, or read their fingerprints); " +
                              kPrivateCopies + ". Remove it (rm -r " + path +
                              ") once no process of the node uses it: the next one makes it anew, this user's alone";
  tell("directory:" + path, message);
  return Status::Error(Code::kHostError, message);
}

}  // namespace

// The key of the store at `path`, read, or drawn where it has none.
static Status node_key(const std::string& path, FingerprintKey* out) {
  StoreDirectory directory(path, true);
  if (directory.fd() < 0) return untrusted_store(path, directory);
  // Chunks are host memory every holder page-locks: files of a disk's file system can be
  // neither (the kernel refuses to page-lock them for long), only tmpfs's.
  struct statfs fs {};
  if (fstatfs(directory.fd(), &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    return Status::Error(Code::kHostError, "the shared backup store " + path +
                                               " is not in memory (tmpfs, as /dev/shm is): backups are not shared "
                                               "(it lies beside the ledger: name one in /dev/shm with "
                                               "TMSL_HOST_LEDGER, or leave it unset, to share them)");
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int fd = openat(directory.fd(), kKeyName, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd >= 0) {
      Status s = read_key(path, fd, out);
      close(fd);
      return s;
    }
    if (errno != ENOENT) return errno_status("opening the shared backup store's key", errno);
    // None yet: drawn, written whole, then named, so no process ever reads half a key.
    FingerprintKey key;
    Status s = FingerprintKey::random(&key);
    if (!s.ok()) return s;
    const int made = openat(directory.fd(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (made < 0) return errno_status("making the shared backup store's key", errno);
    if (write_all(made, reinterpret_cast<const char*>(&key), sizeof(key)).ok() && fchmod(made, 0400) == 0 &&
        link_into(directory.fd(), made, kKeyName)) {
      close(made);
      *out = key;
      return Status::Ok();
    }
    const int error = errno;
    close(made);
    if (error != EEXIST) return errno_status("naming the shared backup store's key", error);
    // Another process named its key first: read theirs.
  }
  return Status::Error(Code::kHostError, "the shared backup store's key kept changing");
}

namespace {

// A chunk of the store not taken: told once per store and `kind` (the first met stands for all).
Status refused_chunk(const char* kind, const std::string& path, const std::string& name, const std::string& why,
                     const std::string& fix) {
  const std::string message = "the shared backup chunk " + path + "/" + name + " is not trusted: " + why +
                              "; the backups of its bytes are private copies here, as with TMSL_SHARE_BACKUPS=0. " +
                              fix;
  tell(std::string(kind) + ":" + path, message);
  return Status::Error(Code::kHostError, message);
}

}  // namespace

const FingerprintKey* NodeStore::content_key() {
  // Decided once: a store that cannot be trusted or read means no sharing (and the reason,
  // for host_memory()), not an error.
  std::call_once(key_once_, [this] {
    Status s = node_key(directory_, &key_);
    has_key_ = s.ok();
    if (!s.ok()) key_refusal_ = s.message();
  });
  return has_key_ ? &key_ : nullptr;
}

const FingerprintKey* NodeStore::store_key_now(HostBudget& node) {
  const FingerprintKey* key = content_key();
  if (key == nullptr || stores_when_alone_) return key;
  return node.alone_on_node() ? nullptr : key;
}

std::string NodeStore::key_refusal() {
  content_key();  // (decided by then)
  return key_refusal_;
}

void NodeStore::note_refusal(const std::string& why) {
  std::lock_guard<std::mutex> lock(refusal_mu_);
  refusal_ = why;
}

std::string NodeStore::refusal() {
  std::lock_guard<std::mutex> lock(refusal_mu_);
  return refusal_;
}

Status NodeStore::open_chunk(const Fingerprint& f, int* fd, bool* here) {
  const std::string& path = directory_;
  *fd = -1;
  StoreDirectory directory(path, true);
  if (directory.fd() < 0) return untrusted_store(path, directory);
  const std::string name = f.name();
  // A chunk this process holds or makes already: one file is never mapped twice in a process
  // (the driver page-locks its pages once).
  *here = HeldChunks::instance().holds(path + "/" + name) || HeldChunks::instance().claims(claim_name(f));
  if (*here) return Status::Ok();
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int chunk = openat(directory.fd(), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (chunk < 0) return errno == ENOENT ? Status::Ok() : errno_status("opening the shared backup chunk " + name, errno);
    struct stat st {};
    // Being removed by its last holder, or renamed by its maker for new bytes (take_back)
    // while this waited for its lock: look again.
    if (!shared_lock(chunk) || !names_file(directory.fd(), name.c_str(), chunk, &st)) {
      close(chunk);
      continue;
    }
    if (!trusted_chunk(st)) {
      close(chunk);
      const std::string foreign = foreign_to_this_user(st, 022);
      return refused_chunk("chunk", path, name,
                           (foreign.empty() ? std::string(S_ISREG(st.st_mode) ? "its owner may write it" : "it is no regular file")
                                            : foreign) + ", so its bytes may not be those its name says",
                           "Remove it (rm " + path + "/" + name + ": its holders keep theirs) and find what changed it");
    }
    if (st.st_size != static_cast<off_t>(f.bytes)) {
      // Cut short (or grown) under its holders: its bytes are not its name's any more. Its
      // name goes, so that this pause and those after it make the chunk anew; its holders
      // learn it at their resume (HostArena::intact).
      unlink_if_named(directory.fd(), chunk, name.c_str());
      close(chunk);
      tell("cut:" + path, "the shared backup chunk " + path + "/" + name + " was cut short to " +
                              std::to_string(st.st_size) + " of its " + std::to_string(f.bytes) +
                              " bytes by a process of this user (truncate) or a cleaner of /dev/shm: it is made "
                              "anew, but the paused backups that held it lost those bytes (their resumes fail, "
                              "naming the tag). Leave the store's files alone while processes use it");
      continue;
    }
    // Held by a process this one cannot see (each holder keeps a record lock on it: another
    // container sharing /dev/shm as this user): its bytes cannot be told from planted ones.
    if (held_in_another_pid_namespace(chunk, kVouchStart, kVouchLength)) {
      close(chunk);
      return refused_chunk("namespace", path, name,
                           "a process of another PID namespace holds it (a container sharing /dev/shm as this "
                           "user, or a process planting it), so nothing here vouches for its bytes",
                           "Give each PID namespace a store of its own (TMSL_HOST_LEDGER, or a /dev/shm of its "
                           "own), or run the processes that share in one");
    }
    hold_range_shared(chunk, kVouchStart, kVouchLength);  // (a holder that cannot vouch still holds it)
    if (!HeldChunks::instance().add(chunk, path + "/" + name)) {  // the process is exiting
      HeldChunks::let_go(chunk, path + "/" + name);
      return Status::Error(Code::kHostError, "the process is exiting: backups are not shared");
    }
    *fd = chunk;
    return Status::Ok();
  }
  return Status::Error(Code::kHostError, "the shared backup chunk " + path + "/" + name + " kept changing");
}

Status NodeStore::new_chunk(size_t size, int* fd) {
  const std::string& path = directory_;
  StoreDirectory directory(path, true);
  if (directory.fd() < 0) return untrusted_store(path, directory);
  const int chunk = openat(directory.fd(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (chunk < 0) return errno_status("making a shared backup chunk in " + path, errno);
  if (ftruncate(chunk, static_cast<off_t>(size)) != 0) {
    const int error = errno;
    close(chunk);
    return errno_status("sizing a shared backup chunk", error);
  }
  hold_range_shared(chunk, kVouchStart, kVouchLength);  // its maker's word, before it has a name
  HeldChunks::instance().note_unnamed(chunk, true);
  *fd = chunk;
  return Status::Ok();
}

Status NodeStore::publish_chunk(int fd, const Fingerprint& f, bool* published) {
  const std::string& path = directory_;
  *published = false;
  StoreDirectory directory(path, false);
  if (directory.fd() < 0) return untrusted_store(path, directory);
  const std::string name = f.name();
  if (fchmod(fd, 0400) != 0) return errno_status("making a shared backup chunk read-only", errno);
  if (flock(fd, LOCK_SH) != 0) return errno_status("holding a shared backup chunk", errno);
  std::string hidden;
  if (HeldChunks::instance().hidden_path(fd, &hidden)) {
    // A chunk taken back: renamed into place (never over another's), or unnamed for good.
    const char* hidden_name = hidden.c_str() + hidden.rfind('/') + 1;
    const bool ours = names_file(directory.fd(), hidden_name, fd);
    // (renameat2 by its number: the portable wheel's glibc floor predates its wrapper.)
    if (!ours ||
        syscall(SYS_renameat2, directory.fd(), hidden_name, directory.fd(), name.c_str(), RENAME_NOREPLACE) != 0) {
      const int error = ours ? errno : ENOENT;  // (not its name any more: it stays unnamed)
      unlink_if_named(directory.fd(), fd, hidden_name);
      HeldChunks::instance().note_hidden_gone(fd);
      flock(fd, LOCK_UN);
      return error == EEXIST || error == ENOENT ? Status::Ok() : errno_status("naming the shared backup chunk " + name, error);
    }
    HeldChunks::instance().note_hidden_gone(fd);
  } else if (!link_into(directory.fd(), fd, name.c_str())) {
    const int error = errno;
    flock(fd, LOCK_UN);
    return error == EEXIST ? Status::Ok() : errno_status("naming the shared backup chunk " + name, error);
  }
  if (!HeldChunks::instance().add(fd, path + "/" + name)) {  // the process is exiting: the name goes again
    HeldChunks::with_directory(path + "/" + name, [&](int dir, const char* chunk) { unlink_if_unheld(dir, fd, chunk); });
    flock(fd, LOCK_UN);
    return Status::Ok();
  }
  HeldChunks::instance().note_unnamed(fd, false);  // held by its name from here
  *published = true;
  return Status::Ok();
}

void NodeStore::discard_chunk(int fd) {
  if (in_forked_child()) return;  // closed when the child started
  std::string hidden;
  if (HeldChunks::instance().hidden_path(fd, &hidden)) {
    HeldChunks::with_directory(hidden, [&](int directory, const char* name) { unlink_if_named(directory, fd, name); });
    HeldChunks::instance().note_hidden_gone(fd);
  }
  HeldChunks::instance().note_unnamed(fd, false);
  close(fd);
}

namespace {

// Whether the claim named `name` (if any) is held by a live process; a stale one (its holder
// died) is removed. false where there is none.
bool claim_held(int directory, const std::string& name) {
  const int fd = openat(directory, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return false;
  struct stat st {};
  bool held = fstat(fd, &st) == 0 && private_to_this_user(st) && flock(fd, LOCK_SH | LOCK_NB) != 0 &&
              errno == EWOULDBLOCK;
  if (!held) unlink_if_unheld(directory, fd, name.c_str());  // stale (or not ours to trust)
  close(fd);
  return held;
}

}  // namespace

Status NodeStore::claim_chunk(const Fingerprint& f, int* claim) {
  const std::string& path = directory_;
  *claim = -1;
  StoreDirectory directory(path, true);
  if (directory.fd() < 0) return untrusted_store(path, directory);
  const std::string name = claim_name(f);
  for (int attempt = 0; attempt < 8; ++attempt) {
    // Locked before it has its name: nobody can find it unheld.
    const int made = openat(directory.fd(), ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (made < 0) return errno_status("making a claim in the shared backup store", errno);
    if (flock(made, LOCK_EX) == 0 && link_into(directory.fd(), made, name.c_str())) {
      *claim = made;
      HeldChunks::instance().note_claim(name, true);
      HeldChunks::instance().note_unnamed(made, true);
      return Status::Ok();
    }
    const int error = errno;
    close(made);
    if (error != EEXIST) return errno_status("claiming a shared backup chunk", error);
    if (claim_held(directory.fd(), name)) return Status::Ok();  // being made by another process
  }
  return Status::Error(Code::kHostError, "the claim of shared backup chunk " + f.name() + " kept changing");
}

void NodeStore::unclaim_chunk(const Fingerprint& f, int claim) {
  if (in_forked_child()) return;  // the parent's claim: closed when the child started
  StoreDirectory directory(directory_, false);
  const std::string name = claim_name(f);
  // Only our own claim's name goes (a stale one may have been replaced by another's).
  if (directory.fd() >= 0) unlink_if_named(directory.fd(), claim, name.c_str());
  HeldChunks::instance().note_claim(name, false);
  HeldChunks::instance().note_unnamed(claim, false);
  close(claim);
}

Status NodeStore::wait_for_chunk(const Fingerprint& f, std::chrono::milliseconds patience, int* fd) {
  const std::string& path = directory_;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  const std::string name = claim_name(f);
  bool here = false;  // (never: the caller waits for another process's chunk)
  for (;;) {
    Status s = open_chunk(f, fd, &here);
    if (!s.ok() || *fd >= 0) return s;
    StoreDirectory directory(path, false);
    if (directory.fd() < 0 || !claim_held(directory.fd(), name)) {
      // Named meanwhile (its maker lets the claim go after naming it), or given up.
      return open_chunk(f, fd, &here);
    }
    if (std::chrono::steady_clock::now() >= deadline) return Status::Ok();
    usleep(500);
  }
}

bool NodeStore::wait_while_others_make_chunks(std::chrono::steady_clock::time_point deadline) {
  if (content_key() == nullptr) return false;  // (no chunks made here, nor waited for)
  const std::string& path = directory_;
  auto others_making = [&] {
    StoreDirectory directory(path, false);
    bool any = false;
    // (This process's own claims are not looked at: they are not the others'.)
    directory.each_claim([&](const char* name) {
      if (!any && !HeldChunks::instance().claims(name)) any = claim_held(directory.fd(), name);
    });
    return any;
  };
  if (!others_making()) return false;
  do {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    usleep(500);
  } while (others_making());
  return true;
}

void NodeStore::release_shared(int fd) {
  std::string path;
  if (HeldChunks::instance().take(fd, &path)) HeldChunks::let_go(fd, path);
}

void NodeStore::retire_chunk(int fd) {
  // (Its record lock stays: this process still vouches for the file it maps.)
  if (!in_forked_child()) flock(fd, LOCK_UN);
}

void NodeStore::adopt_chunk(int retired, int fd) {
  std::string path;
  // No name to remove: the file is held under its new one.
  if (HeldChunks::instance().take(retired, &path)) close(retired);
  // Closing any descriptor of a file drops this process's record locks on it: vouched again.
  hold_range_shared(fd, kVouchStart, kVouchLength);
}

Status NodeStore::take_back_chunk(int fd, bool* taken) {
  *taken = false;
  std::string path;
  const int mode = fcntl(fd, F_GETFL);
  // Only a chunk this process made is open for writing: the others' are read-only here.
  if (in_forked_child() || mode < 0 || (mode & O_ACCMODE) != O_RDWR || !HeldChunks::instance().path_of(fd, &path)) {
    return Status::Ok();
  }
  std::string hidden;
  HeldChunks::with_directory(path, [&](int directory, const char* name) {
    // An exclusive lock is had only where no other process holds it, and nobody takes one
    // meanwhile (open() takes a shared one first, then checks the name still leads here). It
    // stays held while the file is hidden: the garbage collection leaves it alone.
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || !names_file(directory, name, fd)) return;
    // A random name, never put over another's (processes of other pid namespaces share stores).
    for (int attempt = 0; attempt < 4 && !*taken; ++attempt) {
      uint64_t draw = 0;
      if (syscall(SYS_getrandom, &draw, sizeof(draw), 0) != static_cast<long>(sizeof(draw))) return;
      char suffix[24];
      snprintf(suffix, sizeof(suffix), "%016llx", static_cast<unsigned long long>(draw));
      hidden = std::string(kHiddenPrefix) + suffix;
      *taken = syscall(SYS_renameat2, directory, name, directory, hidden.c_str(), RENAME_NOREPLACE) == 0;
      if (!*taken && errno != EEXIST) return;
    }
  });
  if (!*taken) {
    // (A refused conversion may leave no lock: held again, as it was.)
    if (!shared_lock(fd)) return Status::Error(Code::kHostError, "holding a shared backup chunk again failed");
    return Status::Ok();
  }
  HeldChunks::instance().hide(fd, path.substr(0, path.rfind('/') + 1) + hidden);
  return Status::Ok();
}

size_t NodeStore::room() {
  const std::string& path = directory_;
  StoreDirectory directory(path, true);
  return directory.fd() < 0 ? 0 : room_of(directory.fd());
}

size_t NodeStore::room_of(int fd) {
  struct statvfs fs {};
  if (fstatvfs(fd, &fs) != 0) return 0;
  if (fs.f_blocks == 0) return SIZE_MAX;  // a tmpfs without a size (the kernel's own, memfds')
  const size_t total = static_cast<size_t>(fs.f_blocks) * fs.f_frsize;
  const size_t free = static_cast<size_t>(fs.f_bavail) * fs.f_frsize;
  const size_t kept_free = std::max(total / 10, size_t{1} << 30);
  return free > kept_free ? free - kept_free : 0;
}

size_t NodeStore::descriptors_left() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  const size_t most = limit.rlim_cur == RLIM_INFINITY ? size_t{1} << 20 : static_cast<size_t>(limit.rlim_cur);
  size_t open = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++open;  // (".", ".." and the listing's own: a little margin)
    closedir(dir);
  } else {
    return 0;
  }
  const size_t kept = std::max(most / 4, size_t{256});
  return most > open + kept ? most - open - kept : 0;
}

void NodeStore::collect_garbage() {
  const std::string& path = directory_;
  StoreDirectory directory(path, false);
  directory.each_claim([&](const char* name) { claim_held(directory.fd(), name); });
  // (Not the files this process holds: see holds_file().)
  auto held_here = [&](const char* name) { return HeldChunks::instance().holds_file(path + "/" + name); };
  directory.each_hidden([&](const char* name) {  // taken back by a process that died meanwhile
    if (held_here(name)) return;
    const int chunk = openat(directory.fd(), name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (chunk >= 0) {
      unlink_if_unheld(directory.fd(), chunk, name);
      close(chunk);
    }
  });
  directory.each([&](const char* name) {
    if (held_here(name)) return;
    const int chunk = store_files::open_chunk(directory.fd(), name);
    if (chunk >= 0) {
      unlink_if_unheld(directory.fd(), chunk, name);
      close(chunk);
    }
  });
}

}  // namespace tmsl
