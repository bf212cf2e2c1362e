// Backups stored once per node: the content of a paused backup that another process of the
// node holds too (data-parallel replicas and colocated engines hold the same weights) is kept
// in one file both map, instead of a copy in each.
//
// The store is a directory beside the node's ledger (<ledger>.store) of content-addressed
// chunks, each a file named after a hash of its bytes and its size. A chunk is taken only
// after comparing it byte for byte, so a hash collision costs a copy, never content. Each
// holder keeps the file open with a shared flock, which the kernel drops when the holder dies
// (kill -9 included); the last holder to let go, or any process that finds a chunk nobody
// holds, removes it. The ledger counts the store's bytes once, beside the processes' own.
//
// Off unless TMSL_SHARE_BACKUPS=1: sharing runs after each pause, in the background.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <string>

#include "node/host_budget.h"
#include "platform/status.h"

namespace tmsl {

class NodeStore {
 public:
  // Whether TMSL_SHARE_BACKUPS=1 (read once).
  static bool enabled();
  // The store's directory for the ledger at `ledger_path`.
  static std::string directory_for(const std::string& ledger_path);
  // The memory the chunks in `directory` take (0 when there is none, or it is not trusted):
  // what the ledger counts.
  static size_t bytes_in(const std::string& directory);

  // Opens a chunk in the store `directory` holding exactly the `size` bytes at `data`: one of
  // the store's, compared byte for byte, or a new one (a copy, whose bytes are taken from
  // `budget` while it is being made). *fd is open and holds the chunk (a shared flock) until release();
  // *path names it. The store is used only if it is this user's directory that nobody else
  // may write, and a chunk only if it is this user's read-only file.
  static Status share(HostBudget& budget, const std::string& directory, const char* data, size_t size, int* fd,
                      std::string* path);
  // Lets go of a chunk share() opened (its mappings must be gone): closes it, and removes its
  // file when no other process holds it. Chunks still held at exit are let go of then; a
  // forked child closes its copies when it starts.
  static void release(int fd);
  // Removes the chunks in `directory` nobody holds (what processes that died left behind).
  static void collect_garbage(const std::string& directory);
};

// Whether a file (or directory) of /dev/shm, which every user may write, can be trusted: this
// user's (the effective one), and nobody else may write it. The one check for the store and
// the ledger.
bool private_to_this_user(const struct stat& st);

// A 64-bit hash of the bytes (names chunks; equality is always checked byte for byte).
uint64_t content_hash(const char* data, size_t size);

}  // namespace tmsl
