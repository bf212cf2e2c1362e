// Soft pauses, the saver's part (the host copy the GPU maps is tiers/soft_arena.cpp): a pause
// releases a backed-up allocation's device memory as ever, then maps its host copy at its own
// address. Touching the paused tensor (a stray kernel, a graph replayed by mistake, a weight
// update into a sleeping engine) reads and writes the copy over the link instead of faulting,
// and the resume brings back whatever the copy holds then.
#include "core/saver.h"

namespace tmsl {

bool Saver::soft_pauses(const TagInfo& info) const {
  return info.options.value_or(Option::kSoftPause, options_.get(Option::kSoftPause)) != 0;
}

bool Saver::soft_request(const Allocation& a, const HostBuffer& kept) const {
  // (A copy kept from the last cycle serves where it is a soft arena of this allocation's span.)
  return a.backup && a.soft.pauses && !(kept && kept.arena->is_soft() && kept.arena->size() == a.size);
}

namespace {

// Maps the first `count` pieces of an allocation of `size` bytes at `base`, readable and
// writable by the device; on failure unmaps what it mapped. (The handles stay the allocation's.)
Status map_pieces(Backend& backend, int device, uintptr_t base, size_t size, const Pieces& pieces, size_t count) {
  size_t mapped = 0;
  Status s;
  for (; mapped < count; ++mapped) {
    s = backend.map(device, base + pieces.offset(mapped), pieces.length(mapped, size), pieces.handles[mapped]);
    if (!s.ok()) break;
  }
  if (s.ok() && count != 0) s = backend.set_access(device, base, size);
  if (s.ok()) return s;
  for (size_t k = 0; k < mapped; ++k) backend.unmap(device, base + pieces.offset(k), pieces.length(k, size));
  return s;
}

// Unmaps the pieces mapped at `base` (their handles stay); stops at the first failure, giving
// how many it unmapped.
size_t unmap_pieces(Backend& backend, int device, uintptr_t base, size_t size, const Pieces& pieces) {
  size_t k = 0;
  while (k < pieces.handles.size() && backend.unmap(device, base + pieces.offset(k), pieces.length(k, size)).ok()) ++k;
  return k;
}

}  // namespace

void Saver::soft_alias(Allocation& a, const HostBuffer& copy) {
  if (!a.soft.pauses || !copy || !copy.arena->is_soft() || copy.arena->size() != a.size || a.physical.empty()) return;
  size_t granularity = 0;
  uintptr_t alias = 0;
  if (!backend_->granularity(a.device, &granularity).ok() ||
      !backend_->reserve(a.device, a.size, granularity, &alias).ok()) {
    return;  // (the copy reads its own address; the soft copy is mapped there once it landed)
  }
  if (!map_pieces(*backend_, a.device, alias, a.size, a.physical, a.physical.handles.size()).ok()) {
    backend_->free_reservation(a.device, alias, a.size);
    return;
  }
  a.soft.alias = alias;
}

void Saver::soft_swap(Allocation& a, const HostBuffer& copy) {
  if (a.soft.alias == 0 || a.soft.arena) return;
  const size_t unmapped = unmap_pieces(*backend_, a.device, a.va, a.size, a.physical);
  if (unmapped == a.physical.handles.size() && copy.arena->map_at(a.va).ok()) {
    a.soft.arena = copy.arena;
    return;
  }
  // As it was: the device memory at its own address again; the soft copy goes there once the
  // copy has landed (soft_map), as without the alias.
  map_pieces(*backend_, a.device, a.va, a.size, a.physical, unmapped);
}

void Saver::soft_unswap(Allocation& a) {
  if (a.soft.alias == 0) return;
  if (a.soft.arena) {
    soft_unmap(a);  // (what fails to come off is an orphan: tried once more before the memory goes back)
    mappings_.retry();
    a.soft.copy_at = 0;
    map_pieces(*backend_, a.device, a.va, a.size, a.physical, a.physical.handles.size());
  }
  // The copy has stopped (the caller waited for the streams): the alias goes, the memory stays.
  unmap_pieces(*backend_, a.device, a.soft.alias, a.size, a.physical);
  backend_->free_reservation(a.device, a.soft.alias, a.size);
  a.soft.alias = 0;
}

Status Saver::soft_release(Allocation& a, bool* unmapped) {
  const uintptr_t alias = a.soft.alias;
  if (!a.soft.arena) {
    // The swap failed: the device memory is at its own address too, which goes first.
    const size_t gone = unmap_pieces(*backend_, a.device, a.va, a.size, a.physical);
    if (gone != a.physical.handles.size()) {
      map_pieces(*backend_, a.device, a.va, a.size, a.physical, gone);
      soft_unswap(a);
      *unmapped = false;
      return Status::Error(Code::kDriverError, "unmapping memory at " + format_address(a.va) + " failed");
    }
  }
  // Released from here on, whatever fails: the orphans take what does not go now.
  *unmapped = true;
  a.soft.alias = 0;
  Status s = mappings_.take_down(a.device, alias, a.size, a.physical);
  Status range = mappings_.discard(a.device, alias, a.size, Pieces());
  return s.ok() ? range : s;
}

void Saver::soft_map(Allocation& a, const HostBuffer& copy) {
  if (a.soft.arena) {
    // A resume that failed took part of it off: that part back on (else all of it goes).
    if (a.soft.unmapped != 0 && !a.soft.arena->map_at(a.va, 0, a.soft.unmapped).ok()) {
      soft_unmap(a);  // (paused as without)
      return;
    }
    a.soft.unmapped = 0;
    return;
  }
  // (Where an orphan is still mapped in its range, it stays unmapped: paused as without.)
  if (!a.soft.pauses || !copy || !copy.arena->is_soft() || copy.arena->size() != a.size ||
      mappings_.mapped_in(a.device, a.va, a.size)) {
    return;
  }
  if (copy.arena->map_at(a.va).ok()) a.soft.arena = copy.arena;
}

Status Saver::soft_unmap(Allocation& a, size_t to) {
  if (!a.soft.arena || a.soft.unmapped >= to) return Status::Ok();
  size_t end = a.soft.unmapped;
  std::vector<std::pair<size_t, size_t>> failed;
  Status s = a.soft.arena->unmap_at(a.va, a.soft.unmapped, to, &end, &failed);
  // Off from here on, whatever failed: the orphans unmap that later, and keep its addresses
  // from being given back or mapped over meanwhile.
  for (const auto& [at, bytes] : failed) mappings_.adopt(Orphan{a.device, a.va + at, bytes, 0, true, false});
  a.soft.copy_at = reinterpret_cast<uintptr_t>(a.soft.arena->data());
  a.soft.unmapped = end;
  if (end >= a.size) {
    a.soft.arena.reset();  // (its memory stays the tiers' copy)
    a.soft.unmapped = 0;
  }
  if (s.ok()) return s;
  return with_context(s, "taking the soft-paused copy of tag '" + a.tag + "' (" + format_bytes(a.size) + " at " +
                             format_address(a.va) + ") off its address");
}

bool Saver::soft_write_kept(Allocation& a, size_t k, const Fingerprint& restored) {
  if (a.soft.copy_at == 0) return false;
  const size_t from = k * HostArena::kRangeBytes;
  const size_t bytes = std::min(a.backup_bytes(), from + HostArena::kRangeBytes) - from;
  std::vector<Fingerprint> copy;
  if (!tiers_.fingerprint_chunks(a.device, a.soft.copy_at + from, bytes, *a.wake.key, &copy).ok()) return false;
  return copy.size() == 1 && copy[0] == restored;
}

}  // namespace tmsl
