// A soft pause's host copy (HostArena::create_soft): host memory the GPU maps like its own,
// so the pause can leave it mapped at the paused allocation's address. A kernel, a graph
// replay or a copy that touches the paused tensor then reads the copy's bytes and writes into
// the copy, over the link, instead of faulting on an unmapped address
// (benchmarks/probes/README.md#soft-pause).
#include "tiers/backup.h"

namespace tmsl {

Status HostArena::create_soft(std::shared_ptr<Backend> backend, HostBudget& budget, ForegroundGate& gate, int device,
                              size_t size, std::unique_ptr<HostArena>* out) {
  // One buffer: the constructor lays its ranges out, kRangeBytes each from 0, the last shorter.
  std::unique_ptr<HostArena> arena(new HostArena(std::move(backend), budget, nullptr, gate, true, device, {size}));
  arena->soft_ = true;
  arena->pieces_.clear();  // nothing to fault in: the driver makes the memory page-locked
  for (Range& range : arena->ranges_) {
    range.pieces_left = 0;
    range.done = true;
    range.registered = true;
  }
  arena->ranges_left_ = 0;
  Status s = budget.reserve(arena->used_);
  if (!s.ok()) return s;
  arena->reserved_ = true;
  arena->note_use();
  Backend& driver = *arena->backend_;
  uintptr_t va = 0;
  size_t granularity = 0;
  s = driver.granularity(device, &granularity);
  if (s.ok()) s = driver.reserve(device, arena->size_, granularity, &va);
  if (!s.ok()) return with_context(s, "reserving addresses for a soft-paused backup");
  arena->data_ = reinterpret_cast<char*>(va);
  arena->soft_handles_.reserve(arena->ranges_.size());
  for (const Range& range : arena->ranges_) {
    PhysicalHandle handle = 0;
    s = driver.create_host_physical(device, range.size, &handle);
    if (s.code == Code::kOutOfMemory) {
      // The driver's, not the budget's: the caller copies as before instead of making room.
      return Status::Error(Code::kUnsupported, s.message());
    }
    if (!s.ok()) return s;  // (the destructor gives back what was made)
    arena->soft_handles_.push_back(handle);
    s = driver.map(device, va + range.start, range.size, handle);
    if (!s.ok()) return with_context(s, "mapping a soft-paused backup");
    ++arena->soft_mapped_;
  }
  s = driver.set_host_access(device, va, arena->size_);
  if (!s.ok()) return with_context(s, "making a soft-paused backup accessible");
  *out = std::move(arena);
  return Status::Ok();
}

void HostArena::release_soft() {
  // Best effort: the destructor has nobody to tell (a driver error leaks, never crashes).
  const uintptr_t va = reinterpret_cast<uintptr_t>(data_);
  for (size_t k = 0; k < soft_mapped_; ++k) backend_->unmap(device_, va + ranges_[k].start, ranges_[k].size);
  for (size_t k = 0; k < soft_handles_.size(); ++k) {
    backend_->release_host_physical(device_, soft_handles_[k], ranges_[k].size);
  }
  if (data_ != nullptr) backend_->free_reservation(device_, va, size_);
  soft_handles_.clear();
  soft_mapped_ = 0;
  data_ = nullptr;
}

Status HostArena::map_at(uintptr_t va, size_t from, size_t to) {
  size_t first = 0;
  while (first < ranges_.size() && ranges_[first].start < from) ++first;
  size_t end = first;  // past the last range mapped
  Status s;
  for (; end < ranges_.size() && ranges_[end].start < to; ++end) {
    s = backend_->map(device_, va + ranges_[end].start, ranges_[end].size, soft_handles_[end]);
    if (!s.ok()) break;
  }
  if (s.ok() && end > first) {
    const size_t start = ranges_[first].start, stop = ranges_[end - 1].start + ranges_[end - 1].size;
    s = backend_->set_access(device_, va + start, stop - start);
  }
  if (s.ok()) return s;
  for (size_t k = first; k < end; ++k) backend_->unmap(device_, va + ranges_[k].start, ranges_[k].size);
  return with_context(s, "mapping a soft-paused backup at its allocation's address");
}

Status HostArena::unmap_at(uintptr_t va, size_t from, size_t to, size_t* end,
                           std::vector<std::pair<size_t, size_t>>* failed) {
  Status first;
  for (const Range& range : ranges_) {
    if (range.start < from || range.start >= to) continue;
    Status s = backend_->unmap(device_, va + range.start, range.size);
    if (!s.ok() && failed != nullptr) failed->emplace_back(range.start, range.size);
    if (first.ok() && !s.ok()) first = with_context(s, "unmapping a soft-paused backup from its allocation's address");
    if (end != nullptr) *end = range.start + range.size;
  }
  return first;
}

}  // namespace tmsl
