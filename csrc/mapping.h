// The only code that puts physical memory behind a reserved address range or takes it
// away. Everything that maps (allocate, resume) and unmaps (free, pause, rollback,
// teardown) goes through these two functions, so the order and the error handling are
// written once: a handle is released only once it is unmapped, and never dropped silently.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "backend.h"
#include "status.h"

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
// while the next one is created (benchmarks/probe_copy_pipeline.py "chunked", H100: one
// 8 GiB piece took its copy at 48 GB/s, 256 MiB pieces at 54 GB/s).
struct Pieces {
  size_t piece_bytes = 0;
  PieceHandles handles;  // the pieces mapped so far

  bool empty() const { return handles.empty(); }
  // How many pieces cover `size` bytes.
  size_t count(size_t size) const { return (size + piece_bytes - 1) / piece_bytes; }
  size_t offset(size_t k) const { return k * piece_bytes; }
  size_t length(size_t k, size_t size) const { return std::min(piece_bytes, size - offset(k)); }
};

// What a failed map_physical could not clean up after itself (cleanup failing too): the
// caller keeps it to release later. physical == 0: nothing.
struct Leftover {
  PhysicalHandle physical = 0;
  bool mapped = false;  // still mapped at the va
};

// Creates `size` bytes of physical memory on `device` (refused with kOutOfMemory when the
// device would be left with less than `margin` free bytes; 0 = no margin), maps it at
// [va, va + size) and makes it readable and writable. On error it undoes what it did; what
// it could not undo is in *leftover.
Status map_physical(Backend& backend, int device, uintptr_t va, size_t size, size_t margin,
                    PhysicalHandle* out, Leftover* leftover);

// Unmaps [va, va + size), then releases `physical`. When the unmap fails the memory is
// still mapped, so nothing is released and *unmapped (if given) stays false.
Status unmap_physical(Backend& backend, int device, uintptr_t va, size_t size,
                      PhysicalHandle physical, bool* unmapped = nullptr);

}  // namespace tmsl
