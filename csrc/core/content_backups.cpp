// The saver's side of content backups: a pause fingerprints each large backup's memory on its
// device and takes its copy in chunks of the node's store (tiers/content_copies.cpp), copying
// only what no process of the node holds yet. A changed copy this process alone holds (its
// weights after a training step) is copied while it is fingerprinted, piece by piece.
#include <algorithm>

#include "core/copy_marks.h"
#include "core/saver.h"

namespace tmsl {

Status Saver::content_copy(const Allocation& a, const FingerprintKey& key, HostBuffer* kept, HostBuffer* out,
                           std::vector<Fingerprint>* fingerprints, std::chrono::steady_clock::time_point others_by,
                           bool make_room, CopyMarks* in_place_copies) {
  std::vector<Fingerprint>& chunks = *fingerprints;
  const bool kept_content = *kept && kept->size == a.backup_bytes() && kept->arena->is_content();
  const bool kept_whole = kept_content && kept->arena->intact();
  // (Fingerprinted here also where the caller did just before, as share_ahead does: as late as
  // possible, so that bytes still being written when it looked are taken as they end up.)
  bool queued = false;  // copies into *kept are in flight
  Status s = kept_whole && in_place_copies != nullptr
                 ? copy_while_fingerprinting(a, key, *kept, &chunks, in_place_copies, &queued)
                 : tiers_.fingerprint_chunks(a.device, a.va, a.backup_bytes(), key, &chunks);
  if (s.code == Code::kUnsupported && !queued) {  // copied as before
    tiers_.note_store_refusal("the device cannot fingerprint backups (" + s.message() + "): a private copy");
    return s;
  }
  if (!s.ok()) return with_context(s, "fingerprinting tag '" + a.tag + "' (" + format_bytes(a.size) + " at " +
                                          format_address(a.va) + "); everything stays resident with its content");
  if (kept_content) {
    // The same bytes as at its last pause: the copy it kept is taken again as it is. Changed
    // bytes (new weights) go into its own chunks where nobody else needs their old bytes (no
    // fresh memory, none held twice), replicas' into the chunks they share, each rewritten by
    // its maker. A chunk of it cut short meanwhile (intact()) has lost its bytes: the copy is
    // made anew from the memory, which still holds them.
    if (kept_whole && (kept->arena->content() == chunks || kept->arena->recycle(chunks, others_by))) {
      kept->arena->note_use();
      *out = *kept;
      return Status::Ok();
    }
    // Stale, and others hold some of it: freed here, before new chunks are made (never both at
    // once), not in the background after the pause; once nothing is copied into it any more.
    if (queued) {
      s = backend_->wait_copies(a.device);
      if (!s.ok()) return with_context(s, "pausing tag '" + a.tag + "': copying its backup to the host failed; "
                                              "everything stays resident with its content, call pause again");
    }
    HostPool::FreeNow now(tiers_.pool());
    tiers_.copies().take(a.va);
    *kept = HostBuffer();
  }
  size_t new_bytes = 0;
  s = tiers_.content_copy(a.device, a.backup_bytes(), chunks, out, &new_bytes, make_room);
  if (s.code == Code::kUnsupported) return s;  // (no room in the store: copied privately)
  if (!s.ok()) {
    return with_context(s, "pausing tag '" + a.tag + "': no host memory for its " + format_bytes(new_bytes) +
                               " of new backup chunks; everything stays resident with its content, call pause "
                               "again once host memory is free");
  }
  return s;
}

Status Saver::copy_while_fingerprinting(const Allocation& a, const FingerprintKey& key, const HostBuffer& kept,
                                        std::vector<Fingerprint>* chunks, CopyMarks* copies, bool* queued) {
  chunks->clear();
  const size_t bytes = a.backup_bytes();
  bool in_place = true;  // until a chunk needs recycle()'s way: the rest only fingerprinted
  for (size_t from = 0; from < bytes; from += kPipelinedPieceBytes) {
    std::vector<Fingerprint> piece;
    Status s = tiers_.fingerprint_chunks(a.device, a.va + from, std::min(kPipelinedPieceBytes, bytes - from), key, &piece);
    if (!s.ok()) return s;
    const size_t first = chunks->size();
    chunks->insert(chunks->end(), piece.begin(), piece.end());
    if (!in_place) continue;
    const std::vector<size_t> taken = kept.arena->take_in_place(first, piece, &in_place);
    for (size_t t = 0; t < taken.size(); ++t) {
      const size_t at = taken[t] * HostArena::kRangeBytes, n = std::min(HostArena::kRangeBytes, bytes - at);
      if (!*queued) copies->begin();  // (after an error, the pause waits for them)
      *queued = true;
      s = kept.for_each_part(at, n, [&](char* host, size_t offset, size_t part) {
        return backend_->copy_to_host_async(a.device, host, a.va + offset, part);
      });
      if (!s.ok()) {
        for (size_t u = t; u < taken.size(); ++u) kept.arena->forget(taken[u]);  // (none of their copies is whole)
        return s;
      }
    }
  }
  return Status::Ok();
}

void Saver::order_pending_last(std::vector<Allocation*>* batch, std::vector<HostBuffer>* backups) {
  std::vector<size_t> order(batch->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(), [&](size_t i) {
    const HostBuffer& b = (*backups)[i];
    return !b || b.arena->pending_chunks().empty();  // (only a content arena has any)
  });
  std::vector<Allocation*> allocations;
  std::vector<HostBuffer> copies;
  for (size_t i : order) {
    allocations.push_back((*batch)[i]);
    copies.push_back(std::move((*backups)[i]));
  }
  *batch = std::move(allocations);
  *backups = std::move(copies);
}

Status Saver::finish_content(const std::vector<Allocation*>& batch, const std::vector<HostBuffer>& backups,
                             CopyMarks* copies, size_t i) {
  const HostBuffer& backup = backups[i];
  if (!backup) return Status::Ok();
  backup.arena->publish();  // (a content arena's new chunks named: any other has none)
  const std::vector<size_t> pending = backup.arena->pending_chunks();
  if (pending.empty()) return Status::Ok();
  // Another process may be waiting for the chunks this pause makes: all named first.
  for (size_t j = i + 1; j < batch.size(); ++j) {
    Status s = copies->wait(j);
    if (!s.ok()) return with_context(s, "copying backups to the host");
    if (backups[j]) backups[j].arena->publish();
  }
  return settle_pending_chunks(*batch[i], backup, nullptr, nullptr);
}

Status Saver::settle_pending_chunks(const Allocation& a, const HostBuffer& backup, const FingerprintKey* key,
                                    const std::vector<Fingerprint>* before) {
  // One deadline for all of this copy's pending chunks: a process that stopped making them
  // (stopped, not dead) holds the pause up once, not once per chunk.
  const auto deadline = std::chrono::steady_clock::now() + BackupTiers::kPatienceForChunks;
  for (size_t k : backup.arena->pending_chunks()) {
    bool made = false;
    Status s = tiers_.wait_for_chunk(*backup.arena, k, backup.arena->chunk_fingerprint(k), deadline, &made);
    if (s.ok() && made) {
      // Nobody else makes it: copied here, from the memory still resident (unchanged since
      // `before`, where given).
      const size_t from = k * HostArena::kRangeBytes, n = std::min(HostArena::kRangeBytes, backup.size - from);
      s = copy_chunks(a, backup, {{from, n}});
      if (s.ok() && key != nullptr) s = unchanged_since(a, *key, *before);
      if (s.ok()) backup.arena->publish();
    }
    if (!s.ok()) {
      return with_context(s, "pausing tag '" + a.tag + "': a backup chunk another process was making did not "
                                 "come; it stays resident with its content, call pause again");
    }
  }
  return Status::Ok();
}

}  // namespace tmsl
