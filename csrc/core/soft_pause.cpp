// Soft pauses, the saver's part (the host copy the GPU maps is tiers/soft_arena.cpp): a pause
// releases a backed-up allocation's device memory as ever, then maps its host copy at its own
// address. Touching the paused tensor (a stray kernel, a graph replayed by mistake, a weight
// update into a sleeping engine) reads and writes the copy over the link instead of faulting,
// and the resume brings back whatever the copy holds then.
#include "core/saver.h"

namespace tmsl {

bool Saver::soft_pauses(const TagInfo& info) const {
  return info.soft_pause >= 0 ? info.soft_pause == 1 : soft_pause_.load();
}

bool Saver::soft_request(const Allocation& a, const HostBuffer& kept) const {
  // (A copy kept from the last cycle serves where it is a soft arena of this allocation's span.)
  return a.backup && a.soft_pauses && !(kept && kept.arena->is_soft() && kept.arena->size() == a.size);
}

void Saver::soft_map(Allocation& a, const HostBuffer& copy) {
  // (Where an orphan is still mapped in its range, it stays unmapped: paused as without.)
  if (!a.soft_pauses || a.soft || !copy || !copy.arena->is_soft() || copy.arena->size() != a.size ||
      mappings_.mapped_in(a.device, a.va, a.size)) {
    return;
  }
  if (copy.arena->map_at(a.va).ok()) a.soft = copy.arena;
}

Status Saver::soft_unmap(Allocation& a) {
  if (!a.soft) return Status::Ok();
  Status s = a.soft->unmap_at(a.va);
  if (!s.ok()) {
    return with_context(s, "taking the soft-paused copy of tag '" + a.tag + "' (" + format_bytes(a.size) + " at " +
                               format_address(a.va) + ") off its address");
  }
  a.soft_copy_at = reinterpret_cast<uintptr_t>(a.soft->data());
  a.soft.reset();
  return s;
}

bool Saver::soft_write_kept(Allocation& a, size_t k, const Fingerprint& restored) {
  if (a.soft_copy_at == 0) return false;
  const size_t from = k * HostArena::kRangeBytes;
  const size_t bytes = std::min(a.backup_bytes(), from + HostArena::kRangeBytes) - from;
  std::vector<Fingerprint> copy;
  if (!tiers_.fingerprint_chunks(a.device, a.soft_copy_at + from, bytes, *a.wake_key, &copy).ok()) return false;
  if (copy.size() != 1 || !(copy[0] == restored)) return false;
  a.wake_fingerprints[k] = restored;
  return true;
}

}  // namespace tmsl
