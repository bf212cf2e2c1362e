// Copies made of chunks of the node's store (node_store.h), the tiers' side of holding
// identical bytes once per node: a pause fingerprints a large backup's memory where it lies,
// chunk by chunk (kRangeBytes each), and its copy becomes a content arena (backup.h) whose
// chunks the store has are taken as they are; only the new ones are copied, then named.
#include "tiers/backup_tiers.h"

namespace tmsl {

Status BackupTiers::fingerprint_chunks(int device, uintptr_t va, size_t bytes, const FingerprintKey& key,
                                       std::vector<Fingerprint>* out) {
  std::vector<uint64_t> segments(fingerprint_segments_in(bytes) * kFingerprintLanes);
  Status s = backend_->fingerprint(device, va, bytes, key, segments.data());
  if (!s.ok()) return s;
  out->clear();
  // A chunk is a whole number of segments: its fingerprint joins theirs.
  static_assert(HostArena::kRangeBytes % kFingerprintSegmentBytes == 0, "chunks are whole segments");
  for (size_t at = 0; at < bytes; at += HostArena::kRangeBytes) {
    out->push_back(join_segments(segments.data() + at / kFingerprintSegmentBytes * kFingerprintLanes,
                                 std::min(HostArena::kRangeBytes, bytes - at), key));
  }
  return Status::Ok();
}

Status BackupTiers::content_copy(int device, size_t bytes, const std::vector<Fingerprint>& fingerprints,
                                 HostBuffer* out, size_t* new_bytes) {
  std::unique_ptr<HostArena> made;
  Status s = with_room(bytes, [&] {
    // Opened again at each attempt: the arena takes the chunks, also when it fails.
    std::vector<HostArena::Chunk> chunks(fingerprints.size());
    *new_bytes = 0;
    Status opened;
    for (size_t i = 0; i < chunks.size(); ++i) {
      chunks[i].fingerprint = fingerprints[i];
      if (opened.ok()) opened = budget_.open_chunk(fingerprints[i], &chunks[i].fd);
      if (chunks[i].fd < 0) *new_bytes += fingerprints[i].bytes;
    }
    if (!opened.ok()) {
      for (const HostArena::Chunk& chunk : chunks) {
        if (chunk.fd >= 0) budget_.release_shared(chunk.fd);
      }
      return opened;
    }
    return HostArena::create_content(backend_, budget_, gate_, device, bytes, chunks, &made);
  });
  if (!s.ok()) return s;
  // Never pooled: its memory is chunks of the store, never written again.
  *out = HostBuffer{pool_.track(std::move(made), false), 0, bytes};
  return Status::Ok();
}

}  // namespace tmsl
