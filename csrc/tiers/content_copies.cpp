// Copies made of chunks of the node's store (chunk_store.h, handed to the tiers where the
// process shares), the tiers' side of holding identical bytes once per node: a pause
// fingerprints a large backup's memory where it lies, chunk by chunk (kRangeBytes each), and
// its copy becomes a content arena (backup.h) whose chunks the store has are taken as they
// are; only the new ones are copied, then named.
#include <unistd.h>

#include <algorithm>
#include <set>
#include <string>

#include "tiers/backup_tiers.h"

namespace tmsl {

Status BackupTiers::fingerprint_chunks(int device, uintptr_t va, size_t bytes, const FingerprintKey& key,
                                       std::vector<Fingerprint>* out, const CopyMark* after) {
  std::vector<uint64_t> segments(fingerprint_segments_in(bytes) * kFingerprintLanes);
  Status s = backend_->fingerprint(device, va, bytes, key, segments.data(), after);
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
                                 HostBuffer* out, size_t* new_bytes, bool make_room) {
  if (store_ == nullptr) return Status::Error(Code::kUnsupported, "this process does not share backups: a private copy");
  std::unique_ptr<HostArena> made;
  auto attempt = [&] {
    // Opened again at each attempt: the arena takes the chunks, also when it fails.
    // A chunk nobody has is claimed: of processes pausing the same bytes at once, one copies
    // it and the others wait for it (pending), after copying what they claimed themselves.
    // The same bytes twice in this process (a chunk repeated in the copy, or one another copy
    // holds: zeros, say) get a file of their own, never named: the driver page-locks a file's
    // pages once per process.
    std::vector<HostArena::Chunk> chunks(fingerprints.size());
    std::set<std::string> seen;
    *new_bytes = 0;
    // One file per chunk it holds, one per claim: never the descriptors the rest of the
    // process needs (a private copy then, as with sharing off).
    if (2 * chunks.size() > store_->descriptors_left()) {
      return Status::Error(Code::kUnsupported, "no file descriptors left for the node's store: a private copy");
    }
    Status opened;
    for (size_t i = 0; i < chunks.size() && opened.ok(); ++i) {
      HostArena::Chunk& chunk = chunks[i];
      chunk.fingerprint = fingerprints[i];
      chunk.own = !seen.insert(chunk.fingerprint.name()).second;
      if (!chunk.own) opened = store_->open_chunk(chunk.fingerprint, &chunk.fd, &chunk.own);
      if (opened.ok() && chunk.fd < 0 && !chunk.own) {
        opened = store_->claim_chunk(chunk.fingerprint, &chunk.claim);
        if (opened.ok() && chunk.claim >= 0) opened = taken_if_named_meanwhile(&chunk.fd, chunk.fingerprint, &chunk.claim);
      }
      chunk.pending = opened.ok() && chunk.fd < 0 && chunk.claim < 0 && !chunk.own;
      if (chunk.fd < 0 && !chunk.pending) *new_bytes += chunk.fingerprint.bytes;
    }
    // New chunks only where the store's file system keeps room for everyone else: a small
    // /dev/shm (a container's 64 MiB) means a private copy, as with sharing off.
    if (opened.ok() && *new_bytes > store_->room()) {
      opened = Status::Error(Code::kUnsupported, "the node's store has no room for " + format_bytes(*new_bytes) +
                                                     " of new chunks: a private copy");
    }
    if (!opened.ok()) {
      for (const HostArena::Chunk& chunk : chunks) {
        if (chunk.fd >= 0) store_->release_shared(chunk.fd);
        if (chunk.claim >= 0) store_->unclaim_chunk(chunk.fingerprint, chunk.claim);
      }
      return opened;
    }
    return HostArena::create_content(backend_, budget_, *store_, gate_, device, bytes, chunks, &made);
  };
  // Short of room: the pool and the caches give way for the new chunks' bytes (only those).
  auto attempt_with_room = [&] {
    Status tried = attempt();
    return tried.code == Code::kOutOfMemory && make_room ? with_room(*new_bytes, attempt) : tried;
  };
  Status s = attempt_with_room();
  // Still short while other processes are making chunks: tried again once they are done (a
  // copy given up hands its budget back), within one patience for the whole pause. (Nothing
  // of a failed attempt is held meanwhile: its arena let its claims go.) A guess made in the
  // background (no room made) never waits: the pause that follows it would.
  const auto deadline = std::chrono::steady_clock::now() + kPatienceForChunks;
  while (s.code == Code::kOutOfMemory && make_room && store_->wait_while_others_make_chunks(deadline)) {
    s = attempt_with_room();
  }
  // The store failing otherwise (its files: descriptors, inodes, mapping) means a private copy,
  // as with sharing off; only the budget's refusal is the pause's.
  if (!s.ok() && s.code != Code::kOutOfMemory && s.code != Code::kUnsupported) {
    s = Status::Error(Code::kUnsupported, "the node's store: " + s.message() + ": a private copy");
  }
  if (s.code == Code::kUnsupported) note_store_refusal(s.message());  // host_memory() says it
  if (!s.ok()) return s;
  note_store_refusal("");
  // Never pooled: its memory is chunks of the store (written again only by recycle()).
  *out = HostBuffer{pool_.track(std::move(made), false), 0, bytes};
  return Status::Ok();
}

Status BackupTiers::taken_if_named_meanwhile(int* fd, const Fingerprint& f, int* claim) {
  // Its maker names a chunk, then lets its claim go: a look that found nothing and a claim
  // had after that look may lie on either side of both. Looked for again (else two copies of
  // one chunk: the second stays its maker's own, unnamed).
  bool here = false;
  Status s = store_->open_chunk(f, fd, &here);
  if (s.ok() && *fd >= 0) {
    store_->unclaim_chunk(f, *claim);
    *claim = -1;
  }
  return s;
}

Status BackupTiers::wait_for_chunk(HostArena& arena, size_t index, const Fingerprint& f,
                                   std::chrono::steady_clock::time_point deadline, bool* made) {
  *made = false;
  // A chunk retired for its maker to rewrite (HostArena::recycle): that maker, a replica
  // pausing a little later, may not have claimed the new bytes yet.
  const auto maker_expected_until = std::min(arena.maker_expected_until(index), deadline);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    int fd = -1;
    Status s = store_->wait_for_chunk(f, std::max(left, std::chrono::milliseconds(0)), &fd);
    if (!s.ok()) return s;
    if (fd >= 0) return arena.settle_chunk(index, fd);
    if (std::chrono::steady_clock::now() < maker_expected_until) {
      usleep(200);
      continue;
    }
    int claim = -1;
    s = store_->claim_chunk(f, &claim);
    if (s.ok() && claim >= 0) s = taken_if_named_meanwhile(&fd, f, &claim);
    if (!s.ok()) {
      if (claim >= 0) store_->unclaim_chunk(f, claim);
      return s;
    }
    if (fd >= 0) return arena.settle_chunk(index, fd);
    // Claimed again by another process meanwhile: wait for that one, until the deadline.
    if (claim < 0 && std::chrono::steady_clock::now() < deadline) continue;
    *made = true;
    return arena.make_chunk(index, claim);
  }
}

}  // namespace tmsl
