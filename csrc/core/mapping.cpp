#include "core/mapping.h"

#include <algorithm>
#include <new>

namespace tmsl {
namespace {

Status create_within_margin(Backend& backend, int device, size_t size, size_t margin,
                            PhysicalHandle* out) {
  if (margin != 0) {
    size_t free_bytes = 0, total = 0;
    Status s = backend.memory_info(device, &free_bytes, &total);
    if (!s.ok()) return s;
    if (free_bytes < size || free_bytes - size < margin) {
      return Status::Error(Code::kOutOfMemory,
                           format_bytes(size) + " would leave less than the memory margin of " +
                               format_bytes(margin) + " free on device " + std::to_string(device));
    }
  }
  return backend.create_physical(device, size, out);
}

}  // namespace

Status map_physical(Backend& backend, int device, uintptr_t va, size_t size, size_t margin,
                    PhysicalHandle* out, Orphan* orphan) {
  *orphan = Orphan{device, va, size, 0, false, false};
  PhysicalHandle physical = 0;
  Status s = create_within_margin(backend, device, size, margin, &physical);
  if (!s.ok()) return s;
  s = backend.map(device, va, size, physical);
  if (!s.ok()) {
    if (!backend.release_physical(device, physical, size).ok()) orphan->physical = physical;
    return s;
  }
  s = backend.set_access(device, va, size);
  if (!s.ok()) {
    bool unmapped = false;
    if (!unmap_physical(backend, device, va, size, physical, &unmapped).ok()) {
      orphan->physical = physical;
      orphan->mapped = !unmapped;
    }
    return s;
  }
  *out = physical;
  return Status::Ok();
}

Status unmap_physical(Backend& backend, int device, uintptr_t va, size_t size,
                      PhysicalHandle physical, bool* unmapped) {
  Status s = backend.unmap(device, va, size);
  if (!s.ok()) return s;
  if (unmapped != nullptr) *unmapped = true;
  return backend.release_physical(device, physical, size);
}

void Mappings::adopt(const Orphan& orphan) {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    orphans_.push_back(orphan);
    has_orphans_.store(true);
  } catch (const std::bad_alloc&) {
    // No room to remember it: leaked (see mapping.h).
  }
}

bool Mappings::mapped_in(int device, uintptr_t va, size_t size) {
  if (!has_orphans_.load()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_in_locked(device, va, size);
}

bool Mappings::mapped_in_locked(int device, uintptr_t va, size_t size) const {
  for (const Orphan& o : orphans_) {
    if (o.mapped && o.device == device && o.va < va + size && va < o.va + o.size) return true;
  }
  return false;
}

Status Mappings::take_down(int device, uintptr_t va, size_t size, Pieces& physical, bool* unmapped) {
  Status first;
  for (size_t k = 0; k < physical.handles.size(); ++k) {
    const uintptr_t at = va + physical.offset(k);
    const size_t bytes = physical.length(k, size);
    bool done_unmapping = false;
    Status s = unmap_physical(backend_, device, at, bytes, physical.handles[k], &done_unmapping);
    if (k == 0 && unmapped != nullptr && !done_unmapping) {
      *unmapped = false;  // nothing taken down: all of it is still the caller's
      return s;
    }
    if (unmapped != nullptr) *unmapped = true;  // set at once: no longer resident, whatever follows
    if (!s.ok()) {
      adopt({device, at, bytes, physical.handles[k], !done_unmapping, false});
      if (first.ok()) first = std::move(s);
    }
  }
  physical.handles.clear();
  return first;
}

Status Mappings::discard(int device, uintptr_t va, size_t size, Pieces physical) {
  Status first = take_down(device, va, size, physical);
  if (has_orphans_.load()) {
    // Memory may still be mapped in the range (a piece that failed to go, here or in a
    // rollback before): the orphans give the range back once none is.
    adopt({device, va, size, 0, false, true});
    retry();
    return first;
  }
  Status s = backend_.free_reservation(device, va, size);
  if (!s.ok()) adopt({device, va, size, 0, false, true});
  return first.ok() ? s : first;
}

void Mappings::retry() {
  if (!has_orphans_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (Orphan& o : orphans_) {
    Status s;
    if (o.mapped) {
      s = backend_.unmap(o.device, o.va, o.size);
      o.mapped = !s.ok();
    }
    if (s.ok() && o.physical != 0 && backend_.release_physical(o.device, o.physical, o.size).ok()) o.physical = 0;
  }
  for (Orphan& o : orphans_) {
    if (o.range && !mapped_in_locked(o.device, o.va, o.size) &&
        backend_.free_reservation(o.device, o.va, o.size).ok()) {
      o.range = false;
    }
  }
  orphans_.erase(std::remove_if(orphans_.begin(), orphans_.end(),
                                [](const Orphan& o) { return !o.mapped && o.physical == 0 && !o.range; }),
                 orphans_.end());
  has_orphans_.store(!orphans_.empty());
}

}  // namespace tmsl
