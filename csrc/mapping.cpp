#include "mapping.h"

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
                               format_bytes(margin) + " free on device " + std::to_string(device) +
                               " (" + format_bytes(free_bytes) + " free)");
    }
  }
  return backend.create_physical(device, size, out);
}

}  // namespace

Status map_physical(Backend& backend, int device, uintptr_t va, size_t size, size_t margin,
                    PhysicalHandle* out, Leftover* leftover) {
  *leftover = Leftover();
  PhysicalHandle physical = 0;
  Status s = create_within_margin(backend, device, size, margin, &physical);
  if (!s.ok()) return s;
  s = backend.map(device, va, size, physical);
  if (!s.ok()) {
    if (!backend.release_physical(device, physical, size).ok()) *leftover = {physical, false};
    return s;
  }
  s = backend.set_access(device, va, size);
  if (!s.ok()) {
    bool unmapped = false;
    if (!unmap_physical(backend, device, va, size, physical, &unmapped).ok()) *leftover = {physical, !unmapped};
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

}  // namespace tmsl
