// How a resume brings one allocation back: the scratch taken off it, fresh memory mapped in
// pieces, and each piece's copy (or poison) queued as soon as it is mapped.
#include <algorithm>

#include "core/saver.h"

namespace tmsl {

Status Saver::plan_pieces(Allocation& a, bool has_copy) {
  Status s = uncover_stray(a);
  if (!s.ok()) return s;
  Pieces& pieces = a.physical;
  pieces.piece_bytes = a.size;
  a.wake.checked_chunks = 0;  // this resume checks them all
  const size_t wanted = backend_->resume_piece_bytes(a.device);
  if (has_copy && a.size > wanted) {
    size_t granularity = 0;
    s = backend_->granularity(a.device, &granularity);
    if (!s.ok()) return with_context(s, "resuming tag '" + a.tag + "' at " + format_address(a.va));
    pieces.piece_bytes = std::max(granularity, wanted / granularity * granularity);
  }
  pieces.handles.reserve(pieces.count(a.size));  // so that recording a mapped piece cannot throw
  return Status::Ok();
}

Status Saver::map_next_piece(Allocation& a) {
  Pieces& pieces = a.physical;
  const size_t k = pieces.handles.size();
  const uintptr_t at = a.va + pieces.offset(k);
  const size_t bytes = pieces.length(k, a.size);
  // Its soft copy off this piece's addresses first (off each piece in turn: beside the copies).
  Status s = soft_unmap(a, pieces.offset(k) + bytes);
  if (!s.ok()) return s;
  PhysicalHandle physical = 0;
  Orphan orphan;
  s = map_physical(*backend_, a.device, at, bytes, static_cast<size_t>(options_.get(Option::kMemoryMarginBytes)), &physical, &orphan);
  if (orphan.physical != 0) mappings_.adopt(orphan);
  if (s.code == Code::kOutOfMemory) return s;  // the caller explains what the resume needed
  if (!s.ok()) return with_context(s, "resuming tag '" + a.tag + "' at " + format_address(at));
  pieces.handles.push_back(physical);
  return Status::Ok();
}

Status Saver::restore(const Allocation& a, const HostBuffer& copy, size_t k) {
  const size_t from = a.physical.offset(k), end = from + a.physical.length(k, a.size);
  // The backup covers [0, copy.size); the rest of the piece has no content to restore.
  const size_t copied_end = copy ? std::min(end, std::max(from, copy.size)) : from;
  std::string cut;
  if (copied_end > from && !copy.arena->intact(copy.offset + from, copied_end - from, &cut)) {
    // Its bytes are gone for good: no resume can bring them back, so none is woken.
    return Status::Error(Code::kContentMismatch,
                         "resuming tag '" + a.tag + "': the backup of its allocation of " + format_bytes(a.size) +
                             " at " + format_address(a.va) + " cannot be restored: " + cut +
                             ". Nothing was woken: everything this resume covered stays paused. That content "
                             "cannot come back: free the allocation and make it anew (the rest of its tag "
                             "resumes once it is freed).");
  }
  if (copied_end > from) {
    Status s = copy.for_each_part(from, copied_end - from, [&](char* host, size_t at, size_t n) {
      return copy.arena->copy_out(a.device, a.va + at, host, n);
    });
    if (!s.ok()) return with_context(s, "restoring backups");
  }
  if (copied_end == end || !options_.flag(Option::kPoisonOnResume) || tiers_.disk_copies().has(a.va)) return Status::Ok();  // a file fills it
  return with_context(backend_->fill_async(a.device, a.va + copied_end, end - copied_end, kPoisonByte),
                      "poisoning resumed memory");
}

}  // namespace tmsl
