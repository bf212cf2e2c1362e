// The node's store of backups held once (node_store.h), as an interface handed to the backup
// tiers beside the budget (host_budget.h): the store implements it; the api layer makes it and
// hands it down only where this process shares (TMSL_SHARE_BACKUPS, api/node_budget.h), so a
// tier handed none (nullptr) copies privately and makes none of the calls below. The budget
// counts the store's chunks once (node_ledger.h); a new chunk's bytes are its maker's in the
// budget until it is published.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "node/host_budget.h"
#include "platform/fingerprint.h"
#include "platform/status.h"

namespace tmsl {

class ChunkStore {
 public:
  virtual ~ChunkStore() = default;
  // The fingerprint key its chunks are named under; nullptr where the store cannot be used
  // (on a disk, not trusted, its key unreadable), and then none of the calls below is made.
  virtual const FingerprintKey* content_key() = 0;
  // The key to store a backup offered now under: content_key() where another live process of
  // the node uses the library (`node` tells: HostBudget::alone_on_node), or where sharing was
  // asked for by name (TMSL_SHARE_BACKUPS=1); nullptr where this process is alone on the node.
  // A process alone has nobody to share with, and the store's memory would cost it: /dev/shm
  // gives 4 KiB pages (no huge pages on most nodes), faulted in and page-locked one chunk at a
  // time at its first pause, and its next device allocations slow beside them. So it copies
  // privately, as with sharing off, and its next pause after another process arrives stores
  // what it pauses then.
  virtual const FingerprintKey* store_key_now(HostBudget& node) = 0;
  // The chunk of the bytes fingerprinted `f`, held (*fd; -1 where the store has none, or where
  // this process holds or claims it already: *here).
  virtual Status open_chunk(const Fingerprint& f, int* fd, bool* here) = 0;
  // A new, unnamed chunk of `size` bytes for the caller to write (its bytes are the caller's
  // in the budget until published).
  virtual Status new_chunk(size_t size, int* fd) = 0;
  // Names a new chunk, written and never written again, after its fingerprint, and holds it;
  // *published false: the store has those bytes already, the caller's stays unnamed.
  virtual Status publish_chunk(int fd, const Fingerprint& f, bool* published) = 0;
  // Claims the making of the chunk of `f` (*claim >= 0, held until unclaim_chunk, after
  // publishing it or giving up; -1: a live process of the node makes it), and waits until a
  // chunk another process makes is in the store (*fd held; -1: nobody makes it any more, or
  // `patience` ran out).
  virtual Status claim_chunk(const Fingerprint& f, int* claim) = 0;
  virtual void unclaim_chunk(const Fingerprint& f, int claim) = 0;
  virtual Status wait_for_chunk(const Fingerprint& f, std::chrono::milliseconds patience, int* fd) = 0;
  // Waits while other processes of the node are making chunks (claims held), until each is
  // named or given up or `deadline` passes; true once they are done, false where none was
  // (nothing to wait for) or some still were at the deadline. A chunk in the making holds its
  // maker's budget, which a copy given up (one made ahead while its memory was written, say)
  // hands back: a pause short of budget meanwhile tries again after, instead of refusing.
  virtual bool wait_while_others_make_chunks(std::chrono::steady_clock::time_point deadline) = 0;
  // Lets go of a chunk open_chunk or publish_chunk holds / of a new chunk never published.
  virtual void release_shared(int fd) = 0;
  virtual void discard_chunk(int fd) = 0;
  // A chunk this process made and alone holds, unnamed again for new bytes (*taken; false:
  // still held as it was).
  virtual Status take_back_chunk(int fd, bool* taken) = 0;
  // A held chunk's bytes let go of, its file kept open and mapped, for its maker to rewrite in
  // place; then adopted as the chunk `fd` it became (the same file), or released.
  virtual void retire_chunk(int fd) = 0;
  virtual void adopt_chunk(int retired, int fd) = 0;
  // The bytes new chunks may still take in the store (its file system's free space, less
  // what stays free for others); room_of: the same, of the file system of the chunk open at
  // `fd` (looked at again right before its pages are allocated).
  virtual size_t room() = 0;
  virtual size_t room_of(int fd) = 0;
  // How many more files this process may keep open for the store's chunks (one per chunk it
  // holds, one per claim), leaving a quarter of its limit (at least 256) to everything else.
  virtual size_t descriptors_left() = 0;
  // What the latest backup offered to the store met: "" taken into it, else why it became a
  // private copy instead (no room, no descriptors, the store's files failing, a device that
  // cannot fingerprint), which the node's figures report until one is taken again.
  virtual void note_refusal(const std::string& why) = 0;
};

}  // namespace tmsl
