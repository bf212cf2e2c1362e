// Page-locked host memory nobody holds, kept for the next pause of any tag and any shape.
//
// Every arena the tiers make is handed out through track(): when its last holder lets go (a
// resume that keeps no copy, a free, the cache giving way), it comes back here instead of
// being unpinned and unmapped, as long as the pool stays within its limit (what the host
// cache's budget leaves beside the copies it keeps) and the arena may be written again
// (nothing shared, never leased). take() carves pooled arenas anew, page by page, into the
// buffers a batch needs: their ranges stay page-locked and the copies go range by range
// (HostArena::for_each_part), so the old layout does not matter. What the pool lets go is
// freed on the background thread, after the foreground's current work (foreground_gate.h).
// Pooled arenas keep their bytes in the node's budget: the budget is never exceeded.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "tiers/backup.h"

namespace tmsl {

class HostPool {
 public:
  HostPool(BackgroundWork& background, ForegroundGate& gate);
  ~HostPool();  // frees what it holds; arenas let go later are freed where they are let go
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // The arena, shared: once its last holder lets go it comes back here (when `poolable`),
  // or is freed in the background after the foreground's work (else, FreeNow).
  std::shared_ptr<HostArena> track(std::unique_ptr<HostArena> arena, bool poolable);
  // Places a buffer of sizes[i] for each i with (*out)[i] empty in pooled arenas of
  // `device`: the smallest arena that takes them all, else the largest ones first. What
  // finds no room stays empty.
  void take(int device, const std::vector<size_t>& sizes, std::vector<HostBuffer>* out);
  size_t bytes() const;
  size_t bytes_on(int device) const;  // of them, page-locked for `device`
  // The most it holds; a lower limit lets the least recently used arenas go (freed in the
  // background, or here with `now`).
  void set_limit(size_t bytes, bool now = false);
  size_t limit() const;
  // For its lifetime, what comes back over the limit is freed by the thread letting it go
  // (a pause short of host memory needs the bytes back at once), not in the background.
  class FreeNow {
   public:
    explicit FreeNow(HostPool& pool);
    ~FreeNow();
    FreeNow(const FreeNow&) = delete;
    FreeNow& operator=(const FreeNow&) = delete;

   private:
    HostPool& pool_;
  };
  // Frees, on the calling thread, the arenas it let go that wait for the background, and
  // waits for those a thread is freeing now: a pause short of host memory needs the bytes.
  // Never waits for the background queue itself (a task there may wait for the caller).
  void free_pending_now();
  // How many arenas came back to it and how many it let go: what tests observe.
  size_t returns() const;

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the arenas' deleters
};

}  // namespace tmsl
