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
// holds, removes it. The ledger counts the store's bytes once, beside the processes' own (it
// knows the store only as that: shared_holdings.h).
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
// One object per process, made by the api layer (api/node_budget.h) beside the ledger, whose
// directory it takes; it is handed to the tiers as their ChunkStore (chunk_store.h) unless
// TMSL_SHARE_BACKUPS=0 (or TMSL_LIKE_TORCH_MEMORY_SAVER=1 without it): the api layer reads
// that setting, and hands this object whether a process alone on the node stores too
// (TMSL_SHARE_BACKUPS=1: store_key_now, told by the budget whether others are there). Only
// used where the directory is in memory (tmpfs, as /dev/shm is): a ledger named on a disk
// leaves sharing off (content_key() nullptr, key_refusal() says why).
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "node/chunk_store.h"
#include "node/host_budget.h"
#include "node/shared_holdings.h"
#include "platform/fingerprint.h"
#include "platform/status.h"

namespace tmsl {

class NodeStore final : public ChunkStore, public SharedHoldings {
 public:
  // The store in `directory` ("": none: every use fails, its bytes are 0). `stores_when_alone`:
  // sharing was asked for by name (TMSL_SHARE_BACKUPS=1), so a process alone on the node
  // stores its backups too.
  NodeStore(std::string directory, bool stores_when_alone);
  // The store's directory for the ledger at `ledger_path`.
  static std::string directory_for(const std::string& ledger_path);
  const std::string& directory() const { return directory_; }

  // SharedHoldings: the memory the chunks take (0 when there is none, or it is not trusted),
  // what the ledger counts; the chunks and the claims nobody holds removed (what processes
  // that died left behind).
  size_t bytes() override;
  void collect_garbage() override;

  // The node's fingerprint key: the store's `.key`, drawn by the first process that asks
  // (trusted as above), read once; nullptr where it cannot be (key_refusal() says why).
  const FingerprintKey* content_key() override;
  const FingerprintKey* store_key_now(HostBudget& node) override;
  // Why content_key() is nullptr ("" where it is not, or was not asked yet).
  std::string key_refusal();
  // Opens the chunk holding the bytes whose fingerprint is `f`, and holds it (a shared flock)
  // until release_shared(); *fd is -1 where the store has none, or where this process holds or
  // claims it already (*here: one file is never mapped twice in a process).
  Status open_chunk(const Fingerprint& f, int* fd, bool* here) override;
  // A new chunk of `size` bytes, unnamed (nobody else can find it), for the caller to write;
  // discard_chunk() closes it if it is never published.
  Status new_chunk(size_t size, int* fd) override;
  // Names the new chunk at `fd`, whose bytes are written and never written again, after their
  // fingerprint `f`, and holds it until release_shared(). *published is false where another
  // process named the same bytes first: the caller keeps its own, unnamed.
  Status publish_chunk(int fd, const Fingerprint& f, bool* published) override;
  // Claims the making of the chunk of `f` for this process, so that processes pausing the same
  // bytes at once copy each chunk once between them: *claim is held until unclaim_chunk()
  // (after publishing, or when giving up); -1 where a live process of the node claims it
  // already. A claim is a flock on `.claim-<name>`, which the kernel drops when its holder dies.
  Status claim_chunk(const Fingerprint& f, int* claim) override;
  void unclaim_chunk(const Fingerprint& f, int claim) override;
  // Waits until the chunk of `f` is in the store (*fd held, as by open_chunk()), or nobody
  // claims it any more, or `patience` ran out (*fd -1 for both: the caller makes it itself).
  Status wait_for_chunk(const Fingerprint& f, std::chrono::milliseconds patience, int* fd) override;
  // Waits while a process other than this one claims a chunk (is making it), until none does
  // or `deadline` passes: true once none does, false where none did to begin with (or the
  // store has no key) or some still did at the deadline.
  bool wait_while_others_make_chunks(std::chrono::steady_clock::time_point deadline) override;
  // Lets go of a chunk open_chunk() or publish_chunk() holds (its mappings must be gone):
  // closes it, and removes its file when no other process holds it. Chunks still held at exit
  // are let go of then; a forked child closes its copies when it starts.
  void release_shared(int fd) override;
  // Closes a new chunk that was never published.
  void discard_chunk(int fd) override;
  // Takes back a chunk this process made (open for writing) and alone holds: its name goes,
  // and its file, open at fd, is an unnamed new chunk again, for new bytes and publish_chunk().
  // *taken false (the chunk still held as it was) where another process holds it too.
  Status take_back_chunk(int fd, bool* taken) override;
  // Lets go of the bytes of a held chunk, not of its file: the descriptor stays open (its
  // mapping and page-locking stay), so that the chunk's maker may take it back once no process
  // needs its bytes any more and write new ones into it in place (replicas whose weights
  // changed alike). The caller then adopts it under its new name, or lets it go.
  void retire_chunk(int fd) override;
  // The chunk retired at `retired` is in the store again as `fd` (held, as open_chunk() holds
  // it): the same file, rewritten by its maker. retired's descriptor goes, fd stays held.
  void adopt_chunk(int retired, int fd) override;
  // The bytes new chunks may still take in the directory's file system: its free space less
  // what stays free for everyone else there (a tenth of it, at least 1 GiB: NCCL, data
  // loaders and other processes' shared memory live in /dev/shm too); room_of: the same, of
  // the file system holding the file (or directory) open at `fd`.
  size_t room() override;
  size_t room_of(int fd) override;
  // How many more descriptors this process may open for chunks and claims: its limit
  // (RLIMIT_NOFILE) less those open, less a quarter of it (at least 256) kept for everything
  // else (NCCL, sockets, data loaders).
  size_t descriptors_left() override;
  // What the latest backup offered to the store met ("" taken), and what refusal() answers.
  void note_refusal(const std::string& why) override;
  std::string refusal();

  // What the store refused since last asked, one message each, each told once per process (a
  // key or directory others may read or write, a chunk not this user's alone, made in another
  // PID namespace, or cut short): the backups it concerns are private copies.
  static std::vector<std::string> take_notices();
  // How many take_notices() would return now (a pause asks only then).
  static size_t notices_waiting();

 private:
  const std::string directory_;
  const bool stores_when_alone_;
  std::once_flag key_once_;
  FingerprintKey key_;
  bool has_key_ = false;     // set once, under key_once_
  std::string key_refusal_;  // why has_key_ is false, set with it
  std::mutex refusal_mu_;
  std::string refusal_;  // under refusal_mu_: what the latest backup offered to the store met
};

}  // namespace tmsl
