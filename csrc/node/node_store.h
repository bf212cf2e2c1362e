// Backups stored once per node: the content of a paused backup that another process of the
// node holds too (data-parallel replicas and colocated engines hold the same weights) is kept
// in one file every holder maps, instead of a copy in each.
//
// The store is a directory beside the node's ledger (<ledger>.store) of content-addressed
// chunks, each a file named after the fingerprint of its bytes (platform/fingerprint.h): a
// pause fingerprints its memory on the device first and takes the chunks the store has by
// reference, so only new bytes cross the link. The fingerprint's key, which the node's
// processes share, is the store's `.key`. A new chunk is an unnamed file the pause copies into
// and names once its bytes are in, so it never holds bytes other than its name says. Each
// holder keeps the file open with a shared flock, which the kernel drops when the holder dies
// (kill -9 included); the last holder to let go, or any process that finds a chunk nobody
// holds, removes it. The ledger counts the store's bytes once, beside the processes' own.
// A chunk's maker may take it back for new bytes once no other process holds it: replicas
// whose bytes changed alike retire their old chunks (their flocks go, the files stay mapped),
// so each maker rewrites its chunks in place and the others adopt them as they are mapped.
//
// Trust: the store is used only as this user's directory nobody else may read or write, the
// key only as this user's file nobody else may read, a chunk only as this user's read-only
// file that a process of this PID namespace holds (each holder vouches for its chunks with a
// shared record lock: process_identity.h). What is refused means private copies, told once
// (take_notices()). Any process of this user can still change the store's files: a chunk cut
// short under its holders is found by them before they touch it (HostArena::intact).
//
// On unless TMSL_SHARE_BACKUPS=0 (or TMSL_LIKE_TORCH_MEMORY_SAVER=1 without it), and only used
// where the directory is in memory (tmpfs, as /dev/shm is): a ledger named on a disk leaves
// sharing off (key() says why). A process alone on the node does not use it unless
// TMSL_SHARE_BACKUPS=1 asks (HostBudget::store_key_now, which the ledger answers).
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "platform/fingerprint.h"
#include "platform/status.h"

namespace tmsl {

class NodeStore {
 public:
  // Whether this process may share (the process defaults); *why_not names the variable where not.
  static bool enabled(std::string* why_not);
  // The store's directory for the ledger at `ledger_path`.
  static std::string directory_for(const std::string& ledger_path);
  // The memory the chunks in `directory` take (0 when there is none, or it is not trusted):
  // what the ledger counts.
  static size_t bytes_in(const std::string& directory);

  // The node's fingerprint key: the store's `.key`, drawn by the first process that asks
  // (trusted as above).
  static Status key(const std::string& directory, FingerprintKey* out);
  // Opens the chunk holding the bytes whose fingerprint is `f`, and holds it (a shared flock)
  // until release(); *fd is -1 where the store has none, or where this process holds or
  // claims it already (*here: one file is never mapped twice in a process).
  static Status open(const std::string& directory, const Fingerprint& f, int* fd, bool* here);
  // A new chunk of `size` bytes, unnamed (nobody else can find it), for the caller to write;
  // discard() closes it if it is never published.
  static Status create(const std::string& directory, size_t size, int* fd);
  // Names the new chunk at `fd`, whose bytes are written and never written again, after their
  // fingerprint `f`, and holds it until release(). *published is false where another process
  // named the same bytes first: the caller keeps its own, unnamed.
  static Status publish(const std::string& directory, int fd, const Fingerprint& f, bool* published);
  // Claims the making of the chunk of `f` for this process, so that processes pausing the same
  // bytes at once copy each chunk once between them: *claim is held until unclaim() (after
  // publish(), or when giving up); -1 where a live process of the node claims it already. A
  // claim is a flock on `.claim-<name>`, which the kernel drops when its holder dies.
  static Status claim(const std::string& directory, const Fingerprint& f, int* claim);
  static void unclaim(const std::string& directory, const Fingerprint& f, int claim);
  // Waits until the chunk of `f` is in the store (*fd held, as by open()), or nobody claims it
  // any more, or `patience` ran out (*fd -1 for both: the caller makes it itself).
  static Status wait_for(const std::string& directory, const Fingerprint& f, std::chrono::milliseconds patience,
                         int* fd);
  // Waits while a process other than this one claims a chunk in `directory` (is making it),
  // until none does or `deadline` passes: true once none does, false where none did to begin
  // with or some still did at the deadline.
  static bool wait_while_others_make(const std::string& directory, std::chrono::steady_clock::time_point deadline);
  // Lets go of a chunk open() or publish() holds (its mappings must be gone): closes it, and
  // removes its file when no other process holds it. Chunks still held at exit are let go of
  // then; a forked child closes its copies when it starts.
  static void release(int fd);
  // Closes a new chunk that was never published.
  static void discard(int fd);
  // Lets go of the bytes of a chunk open() or publish() holds, not of its file: the descriptor
  // stays open (its mapping and page-locking stay), so that the chunk's maker may take it back
  // once no process needs its bytes any more and write new ones into it in place (replicas
  // whose weights changed alike). The caller then adopts it under its new name, or lets it go
  // (release).
  static void retire(int fd);
  // The chunk retired at `retired` is in the store again as `fd` (held, as open() holds it):
  // the same file, rewritten by its maker. retired's descriptor goes, fd stays held.
  static void adopt(int retired, int fd);
  // Takes back a chunk this process made (open for writing) and alone holds: its name goes,
  // and its file, open at fd, is an unnamed new chunk again, for new bytes and publish().
  // *taken false (the chunk still held as it was) where another process holds it too.
  static Status take_back(int fd, bool* taken);
  // The bytes new chunks may still take in `directory`'s file system: its free space less
  // what stays free for everyone else there (a tenth of it, at least 1 GiB: NCCL, data
  // loaders and other processes' shared memory live in /dev/shm too).
  static size_t room(const std::string& directory);
  // The same, of the file system holding the file (or directory) open at `fd`.
  static size_t room_of(int fd);
  // How many more descriptors this process may open for chunks and claims: its limit
  // (RLIMIT_NOFILE) less those open, less a quarter of it (at least 256) kept for everything
  // else (NCCL, sockets, data loaders).
  static size_t descriptors_left();
  // Removes the chunks in `directory` nobody holds, and the claims nobody holds (what processes
  // that died left behind).
  static void collect_garbage(const std::string& directory);
  // What the store refused since last asked, one message each, each told once per process (a
  // key or directory others may read or write, a chunk not this user's alone, made in another
  // PID namespace, or cut short): the backups it concerns are private copies.
  static std::vector<std::string> take_notices();
  // How many take_notices() would return now (a pause asks only then).
  static size_t notices_waiting();
};

// Whether a file (or directory) of /dev/shm, which every user may write, can be trusted: this
// user's (the effective one), and nobody else may write it. The one check for the store and
// the ledger.
bool private_to_this_user(const struct stat& st);

}  // namespace tmsl
