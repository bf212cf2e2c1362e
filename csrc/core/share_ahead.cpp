// Content backups made ahead: where the process shares backups, leaving a backed-up region
// (prepare_backups, in the background, during the first rollout) also takes each of its large
// backups into the node's store as a pause would: fingerprinted on the device, its new chunks
// copied and named, the chunks others are making waited for. The content arena is kept as a
// resume keeps one (HostCopies, resident), so the first pause of the same bytes copies nothing
// (content_copy takes the kept arena) and the first cycle runs as the later ones do.
//
// The memory is the user's meanwhile: a chunk is named only where the device memory's
// fingerprint after its copy landed is the one taken before it, so a write racing the copy
// (a weight update into the engine, say) leaves the chunk unnamed and the arena unkept; the
// pause then fingerprints and copies afresh. Memory with a chunk of zeros, or a chunk like
// another, is left to the pause: untouched memory reads as zeros (weights loaded after their
// region are not there yet), and making it ahead would hold the store's memory for nothing.
#include <algorithm>
#include <exception>

#include "core/saver.h"

namespace tmsl {

void Saver::share_ahead(const TagSelection& selection) {
  // Alone on the node: nobody to share with, and its pause copies privately.
  const FingerprintKey* key = tiers_.store_key_now();
  if (key == nullptr || tiers_.closing()) return;
  std::lock_guard<std::mutex> op(op_mu_);  // no pause or resume meanwhile
  std::vector<uintptr_t> wanted;  // looked up again one at a time: a free may come between
  {
    std::lock_guard<std::mutex> lock(mu_);
    for_each_selected(selection, [&](const Allocation& a) {
      if (wants_ahead(a, *key)) wanted.push_back(a.va);
    });
  }
  for (uintptr_t va : wanted) {
    // (Under the operation lock: a cache set to no bytes meanwhile would keep nothing.)
    if (tiers_.closing() || tiers_.cache_bytes() == 0) return;
    Allocation* a = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = table_.find(va);
      if (it == table_.end() || !wants_ahead(it->second, *key)) continue;
      a = &it->second;
      a->ahead.sharing = true;  // a free of it waits until it is cleared below: its memory is read
    }
    HostBuffer copy;
    try {
      copy = share_one_ahead(*a, *key);
    } catch (const std::exception&) {
      copy = HostBuffer();  // (best effort: the pause makes it)
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      a->ahead.sharing = false;
      try {
        if (copy) tiers_.copies().put_if_absent(va, copy, a->device, CopyState::kResident);
      } catch (const std::exception&) {
      }
    }
    settled_.notify_all();
    // (A copy not kept goes here, and with it its claims and unnamed chunks.)
  }
}

bool Saver::wants_ahead(const Allocation& a, const FingerprintKey& key) {
  if (a.state != State::kActive || !a.backs_up() || !content_addressed(a, &key) || soft_pauses(*a.tag_info) ||
      !(options_.flag(Option::kRetainCpuBackup) || resumed(a).cacheable)) {
    return false;
  }
  return !tiers_.copies().peek({a.va})[0];  // (none kept from a resume, none set aside)
}

HostBuffer Saver::share_one_ahead(const Allocation& a, const FingerprintKey& key) {
  // A copy given up (written meanwhile, say) is freed here, its share of the budget with it,
  // not once the foreground is quiet: the pause that comes next may need the room.
  HostPool::FreeNow now(tiers_.pool());
  HostBuffer copy;
  std::vector<Fingerprint> before;
  Status s = tiers_.fingerprint_chunks(a.device, a.va, a.backup_bytes(), key, &before);
  if (!s.ok() || looks_unwritten(before, key)) return HostBuffer();
  // Memory being written now (weights loading into it) is left to the pause: a copy made of it
  // would be given up, and meanwhile its new chunks would hold budget a pause elsewhere needs.
  std::vector<Fingerprint> again;
  s = tiers_.fingerprint_chunks(a.device, a.va, a.backup_bytes(), key, &again);
  if (!s.ok() || again != before) return HostBuffer();
  // (No room made: a guess made in the background takes no other copy's memory, this process's or another's.)
  HostBuffer none;
  if (!content_copy(a, key, &none, &copy, &before, std::chrono::steady_clock::now(), false).ok() || !copy || !copy.arena->is_content()) {
    return HostBuffer();
  }
  s = copy_chunks(a, copy, copy.arena->writable_parts(copy.offset, copy.size));
  if (s.ok()) s = unchanged_since(a, key, before);
  if (s.ok()) {
    copy.arena->publish();
    s = settle_pending_chunks(a, copy, &key, &before);
  }
  if (!s.ok()) {
    copy.arena->drop_claims();  // those waiting for its chunks go on at once
    return HostBuffer();
  }
  return copy;
}

bool Saver::looks_unwritten(const std::vector<Fingerprint>& chunks, const FingerprintKey& key) {
  Fingerprint zeros;  // (of the last size seen: chunks are all of one size but the last)
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (zeros.bytes != chunks[i].bytes) zeros = fingerprint_of_zeros(chunks[i].bytes, key);
    if (chunks[i] == zeros) return true;
    if (std::find(chunks.begin() + i + 1, chunks.end(), chunks[i]) != chunks.end()) return true;
  }
  return false;
}

Status Saver::copy_chunks(const Allocation& a, const HostBuffer& copy, const std::vector<std::pair<size_t, size_t>>& parts) {
  Status s;
  for (const auto& [from, n] : parts) {
    s = copy.for_each_part(from, n, [&](char* host, size_t at, size_t part) {
      return backend_->copy_to_host_async(a.device, host, a.va + at, part);
    });
    if (!s.ok()) break;
  }
  // (Waited for also when queuing failed midway: nothing may still write into it.)
  const Status waited = backend_->wait_copies(a.device);
  return s.ok() ? waited : s;
}

Status Saver::unchanged_since(const Allocation& a, const FingerprintKey& key, const std::vector<Fingerprint>& before) {
  std::vector<Fingerprint> after;
  Status s = tiers_.fingerprint_chunks(a.device, a.va, a.backup_bytes(), key, &after);
  if (s.ok() && after != before) {
    s = Status::Error(Code::kInvalidArgument, "tag '" + a.tag + "' was written while its backup was made ahead");
  }
  return s;
}

}  // namespace tmsl
