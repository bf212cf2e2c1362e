// Every host copy of a saver's allocations, one owner for them all: keyed by the
// allocation's address, each entry holds the copy (a slice of a host arena), where its
// allocation stands as the saver last said (resident, moving, paused), whether retention
// kept it past a resume, and its device. The saver keeps the table of allocations
// (addresses, states, physical memory) and pushes values in at each step: a pause that
// settles puts its copies, a resume takes or keeps them, a free erases one, a lease reads
// one. Nothing here calls into the saver.
//
// What the host cache is made of is judged here too: the arenas whose every copy is a
// resident allocation's and not retained (cached_arenas), least recently used first, what
// they hold (cached_bytes), and taking them (take_cache). The budget's side of it (how
// much stays, the node's figure) is BackupTiers' (host_cache.cpp).
//
// A copy in a content arena (backup.h: chunks of the node's store) stays after a resume,
// whatever the cache's budget: the next pause of unchanged bytes takes it again as it is, and
// a resume sets no private memory aside for it. It is cache like any other all the same (given
// back on request, or when the budget needs the room), counted by the memory that is this
// process's own.
//
// Locking: its own mutex, taken after the saver's table lock where both are held; under it
// only an arena's own lock is taken (poolable, content). Host buffers it lets go are returned
// to the caller, who drops them off its lock (an arena's last holder may free it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <mutex>
#include <utility>
#include <vector>

#include "tiers/backup.h"

namespace tmsl {

// Where a copy's allocation stands, as the saver last said.
enum class CopyState {
  kResident,  // mapped: its copy, if any, is cache (stale) or retained
  kMoving,    // claimed by a pause or resume under way: its copy is that operation's
  kPaused,    // paused: its copy holds its content
};

class HostCopies {
 public:
  HostCopies() = default;
  HostCopies(const HostCopies&) = delete;
  HostCopies& operator=(const HostCopies&) = delete;

  // va's copy becomes `copy` (state `state`, not retained); the copy it replaces, if any, is
  // returned for the caller to let go.
  HostBuffer put(uintptr_t va, HostBuffer copy, int device, CopyState state);
  // Puts `copy` only where va has none; false (and `copy` untouched) where it has one.
  bool put_if_absent(uintptr_t va, HostBuffer& copy, int device, CopyState state);
  // Takes va's copy out (none: an empty buffer).
  HostBuffer take(uintptr_t va);
  // A copy of each va's buffer (empty where it has none).
  std::vector<HostBuffer> peek(const std::vector<uintptr_t>& vas);
  // Sets the state of each va's copy (those without one are skipped).
  void note_state(const std::vector<uintptr_t>& vas, CopyState state);

  // A pause of `vas` settled: vas[i < done] take (*backups)[i] as their copy (paused), the
  // rest are resident again with the copy they had. What is replaced, and the backups not
  // taken, go to *let_go.
  void settle_pause(const std::vector<uintptr_t>& vas, const std::vector<int>& devices, size_t done,
                    std::vector<HostBuffer>* backups, std::vector<HostBuffer>* let_go);
  // What a resume tells of one allocation it settles.
  struct Resumed {
    uintptr_t va = 0;
    bool cacheable = true;  // its region and tag let its copy stay after a resume ("pinned")
    bool uncached = false;  // its region asked for "mmap" copies: host memory given back at once
  };
  // A resume settled: batch[i < done] are resident and keep their copies where they may stay
  // in the cache (cached_after_resume) and `drop` is false (retained where `retain`); a copy
  // in a content arena stays whatever `drop` says while `keep_content` (the cache has a
  // budget at all). The copies that go are returned in *free_now ("mmap" regions: before the
  // resume returns) or *let_go. batch[i >= done] stay paused.
  void settle_resume(const std::vector<Resumed>& batch, size_t done, bool drop, bool retain, bool keep_content,
                     std::vector<HostBuffer>* let_go, std::vector<HostBuffer>* free_now);
  // Whether a copy may stay cached after a resume: always one in a content arena (its bytes
  // are the store's); otherwise when backups are retained or its region and tag cache them.
  static bool cached_after_resume(const HostBuffer& copy, bool cacheable, bool retain) {
    return (copy && copy.arena->is_content()) || retain || cacheable;
  }

  // What a lease finds at va: whether it has a copy, and the copy handed out (while paused,
  // or retained).
  HostBuffer lease(uintptr_t va, bool paused, bool* has_copy);

  // The copies of resident allocations, all taken out (the cache and retained copies).
  std::vector<HostBuffer> take_resident();
  // The vas with a copy and its size, in address order (the saver's figures).
  std::vector<std::pair<uintptr_t, size_t>> sizes() const;
  // The addresses whose copies are the node's store's chunks (content arenas), in order.
  std::vector<uintptr_t> in_store() const;
  // Bytes of every copy (what figures and tests observe).
  size_t total_bytes() const;
  // Bytes of the node's store its copies map (content arenas' chunks held once by the node).
  size_t store_bytes() const;

  // Host memory the cache holds: every arena a resident allocation keeps a copy in, counted
  // whole (an arena stays while any buffer of it is kept) by what is this process's own, and
  // those of `more`.
  size_t cached_bytes(const std::vector<HostBuffer>& more = {}) const;
  // One whole cached arena: every copy in it a resident allocation's, none retained.
  struct CachedArena {
    HostArena* arena;
    std::vector<uintptr_t> holders;
  };
  // The bytes of the whole cached arenas, but those in `except`: summed under the lock,
  // where every arena is still held.
  size_t cached_arena_bytes(const std::set<const HostArena*>& except = {}) const;
  // Takes the copies out of whole cached arenas, least recently used first, until at least
  // `bytes` are let go or none is left (retained copies stay); the caller frees them.
  std::vector<HostBuffer> take_cache(size_t bytes);
  // Takes the copies of whole cached arenas of the devices in *missing that may serve other
  // buffers (poolable), least recently used first, until each device's bytes are covered
  // (*missing is lowered by what each gives).
  std::vector<HostBuffer> take_cached_for(std::map<int, size_t>* missing);

 private:
  struct Entry {
    HostBuffer copy;
    CopyState state = CopyState::kResident;
    bool retained = false;  // outlived a resume because backups were retained: handed out while resident
    int device = 0;
  };
  size_t cached_bytes_locked(const std::vector<HostBuffer>& more) const;
  std::vector<CachedArena> cached_arenas_locked() const;

  mutable std::mutex mu_;
  std::map<uintptr_t, Entry> entries_;
};

}  // namespace tmsl
