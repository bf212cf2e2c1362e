// An allocation's device memory put behind its reserved address range and taken away:
// allocate and resume create and map it here (map_physical); free, pause, rollback and teardown
// unmap and release it here (Mappings), but for a soft pause's moves (core/soft_pause.cpp).
//
// A handle is released only once it is unmapped, and never dropped silently. What cannot be
// taken down now is an orphan, kept by the saver's Mappings and retried until released.
//
// Three other things are mapped at a saver's address ranges, each by its own owner: a soft
// pause moves an allocation's device memory to a second address and back while its copy is
// made (core/soft_pause.cpp), the stray catcher maps its scratch over a paused range
// (core/stray_catcher.h), and a soft pause's host copy is mapped at the paused allocation's
// address (tiers/soft_arena.cpp). What of these fails to come off becomes an orphan here too.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "platform/backend.h"
#include "platform/status.h"

namespace tmsl {

// An allocation's piece handles. Most allocations are one piece: the first handle is held
// inline, so recording it takes no heap memory (one allocation fewer on every cudaMalloc);
// only further pieces use the heap.
class PieceHandles {
 public:
  PieceHandles() = default;
  PieceHandles(PieceHandles&& other) noexcept
      : count_(std::exchange(other.count_, 0)), first_(other.first_), rest_(std::move(other.rest_)) {}
  PieceHandles& operator=(PieceHandles&& other) noexcept {
    count_ = std::exchange(other.count_, 0);
    first_ = other.first_;
    rest_ = std::move(other.rest_);
    return *this;
  }

  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  PhysicalHandle operator[](size_t k) const { return k == 0 ? first_ : rest_[k - 1]; }
  // Room for `n` handles, so that push_back up to there cannot throw.
  void reserve(size_t n) {
    if (n > 1) rest_.reserve(n - 1);
  }
  void push_back(PhysicalHandle handle) {
    if (count_ == 0) first_ = handle;
    else rest_.push_back(handle);
    ++count_;
  }
  void clear() {
    count_ = 0;
    rest_.clear();
  }

 private:
  size_t count_ = 0;
  PhysicalHandle first_ = 0;
  std::vector<PhysicalHandle> rest_;
};

// The physical memory behind an allocation's range, in address order: one handle for each
// piece of piece_bytes (the last piece may be shorter). An allocation is made in one piece;
// a resume maps a large backed-up one in several, so that the copy into each piece runs
// while the next one is created (benchmarks/probes/README.md#chunked-resume).
struct Pieces {
  size_t piece_bytes = 0;
  PieceHandles handles;  // the pieces mapped so far

  bool empty() const { return handles.empty(); }
  // How many pieces cover `size` bytes.
  size_t count(size_t size) const { return (size + piece_bytes - 1) / piece_bytes; }
  size_t offset(size_t k) const { return k * piece_bytes; }
  size_t length(size_t k, size_t size) const { return std::min(piece_bytes, size - offset(k)); }
};

// Physical memory (physical != 0, still mapped at [va, va + size) if `mapped`) and an
// address range (`range`) not yet given back. A range is given back only once no orphan has
// memory mapped inside it.
struct Orphan {
  int device = 0;
  uintptr_t va = 0;
  size_t size = 0;
  PhysicalHandle physical = 0;  // still to release (0: none)
  bool mapped = false;          // still to unmap first
  bool range = false;           // the address range still to give back, last
};

// Creates `size` bytes of physical memory on `device` (refused with kOutOfMemory when the
// device would be left with less than `margin` free bytes; 0 = no margin), maps it at
// [va, va + size) and makes it readable and writable. On error it undoes what it did; what
// it could not undo is in *orphan (physical != 0), for the caller to adopt.
Status map_physical(Backend& backend, int device, uintptr_t va, size_t size, size_t margin,
                    PhysicalHandle* out, Orphan* orphan);

// Unmaps [va, va + size), then releases `physical`. When the unmap fails the memory is
// still mapped, so nothing is released and *unmapped (if given) stays false.
Status unmap_physical(Backend& backend, int device, uintptr_t va, size_t size,
                      PhysicalHandle physical, bool* unmapped = nullptr);

// One saver's taking down of memory, and its orphans: what a failed unmap, release or
// range release left behind, retried (retry) until it is all given back.
class Mappings {
 public:
  explicit Mappings(Backend& backend) : backend_(backend) {}

  // Keeps `orphan` to retry; never throws (without room to remember it, it is leaked, which
  // is better than a caller that goes on believing it still holds what was taken down).
  void adopt(const Orphan& orphan);
  // Whether an orphan still has memory mapped inside [va, va + size) on `device`.
  bool mapped_in(int device, uintptr_t va, size_t size);
  // Unmaps and releases the pieces of [va, va + size) mapped in `physical`, and empties it.
  // Whatever of it fails is kept as an orphan rather than leaked; except that with
  // `unmapped` given, when the first piece's unmap fails nothing was taken down and
  // everything stays the caller's (*unmapped false, `physical` untouched).
  Status take_down(int device, uintptr_t va, size_t size, Pieces& physical, bool* unmapped = nullptr);
  // Gives an allocation up entirely: unmaps and releases its physical memory (none when
  // paused) and gives its address range back. What fails is left to orphans, so nothing is
  // leaked and no range is given back while memory is still mapped inside it.
  Status discard(int device, uintptr_t va, size_t size, Pieces physical);
  // Tries again to release what failed to be released before (the saver calls it at each
  // pause, resume and free, and when it goes), so a passing driver error leaks nothing for good.
  void retry();

 private:
  bool mapped_in_locked(int device, uintptr_t va, size_t size) const;  // needs mu_

  Backend& backend_;
  // Held through a whole retry (backend calls included), so a range is never judged free
  // while another thread holds memory mapped inside it. Never taken under the saver's table
  // lock or the reverse.
  std::mutex mu_;
  std::vector<Orphan> orphans_;  // under mu_
  std::atomic<bool> has_orphans_{false};
};

}  // namespace tmsl
