// Verified wakes: a pause fingerprints each backed-up allocation where it lies (on its GPU,
// beside the copies), and the resume fingerprints the restored bytes and compares, so a backup
// changed or damaged while paused (host memory written by mistake, a disk file, a store chunk)
// fails the resume instead of waking an engine on wrong bytes. The fingerprint is the content
// store's (platform/fingerprint.h): 2^-127 for two different chunks to match.
#include <algorithm>

#include "core/saver.h"

namespace tmsl {

namespace {

// "0x7f00.. (+64.00 MiB .. +128.00 MiB)": where in an allocation a chunk lies.
std::string chunk_range(uintptr_t va, size_t chunk, size_t bytes) {
  const size_t from = chunk * HostArena::kRangeBytes;
  return "bytes " + format_bytes(from) + " to " + format_bytes(std::min(bytes, from + HostArena::kRangeBytes)) +
         " of it (from " + format_address(va + from) + ")";
}

}  // namespace

bool Saver::checks_wakes_of(const TagInfo& info) {
  // (A tag only turns its checks off: none of its own means the default, on.)
  return info.options.value_or(Option::kVerifyWake, option_default(Option::kVerifyWake)) != 0;
}

bool Saver::wake_check_on(const Allocation& a) const { return options_.flag(Option::kVerifyWake) && a.wake.verify; }

Status Saver::take_wake_fingerprints(const std::vector<Allocation*>& batch, bool* taken) {
  if (*taken) return Status::Ok();
  *taken = true;
  for (Allocation* a : batch) {
    if (!a->copied() || !a->wake.fingerprints.empty()) continue;  // (content copies: theirs)
    a->wake.unchecked = !wake_check_on(*a) || !fingerprintable(a->backup_bytes());
    if (a->wake.unchecked) continue;
    // One key per process (the store's where it shares): the device keeps the last one it had.
    const FingerprintKey* key = &process_key();
    Status s = tiers_.fingerprint_chunks(a->device, a->va, a->backup_bytes(), *key, &a->wake.fingerprints);
    if (s.code == Code::kUnsupported) {
      a->wake.fingerprints.clear();  // not checked: the tag's stats say so
      a->wake.unchecked = true;
      continue;
    }
    if (!s.ok()) {
      return with_context(s, "fingerprinting tag '" + a->tag + "' (" + format_bytes(a->size) + " at " +
                                 format_address(a->va) + ") for its wake's check; what has a backup stays "
                                 "resident with its content, call pause again (or turn verify_wake off)");
    }
    a->wake.key = key;
  }
  return Status::Ok();
}

Status Saver::check_wake_chunks(Allocation& a, size_t end, const CopyMark* after) {
  const size_t first = a.wake.checked_chunks;
  if (end <= first) return Status::Ok();
  const size_t from = first * HostArena::kRangeBytes, to = std::min(a.backup_bytes(), end * HostArena::kRangeBytes);
  std::vector<Fingerprint> restored;
  Status s = tiers_.fingerprint_chunks(a.device, a.va + from, to - from, *a.wake.key, &restored, after);
  if (!s.ok()) {
    return with_context(s, "checking the restored content of tag '" + a.tag + "' at " + format_address(a.va) +
                               "; everything this resume covered stays paused with its backups kept, call "
                               "resume again");
  }
  for (size_t k = first; k < end; ++k) {
    if (restored[k - first] == a.wake.fingerprints[k] || soft_write_kept(a, k, restored[k - first])) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      a.tag_info->last_wake_check = WakeCheck::kFailed;
    }
    return Status::Error(
        Code::kContentMismatch,
        "resuming tag '" + a.tag + "': its allocation of " + format_bytes(a.size) + " at " + format_address(a.va) +
            " on device " + std::to_string(a.device) + " came back with bytes other than its pause saw, in " +
            chunk_range(a.va, k, a.backup_bytes()) +
            ": its backup was changed or damaged while paused (a write into a CPU backup view, a "
            "damaged disk file or host memory). Nothing was woken: everything this resume covered stays "
            "paused with its backups as they are. Repair or rewrite the content and resume again, or "
            "turn verify_wake off to take the backup as it is.");
  }
  a.wake.checked_chunks = end;
  return Status::Ok();
}

Status Saver::check_wake_behind(Allocation& a, size_t restored, WakeCheckBehind* behind) {
  if (behind->marked) {
    // The chunks wholly restored by the pieces before this one (all of them, at the end).
    Allocation& earlier = *behind->a;
    const size_t chunks = earlier.wake.fingerprints.size();
    const size_t end = behind->restored >= earlier.backup_bytes() ? chunks : behind->restored / HostArena::kRangeBytes;
    Status s = check_wake_chunks(earlier, end, &behind->mark);
    const Status waited = drop_wake_mark(behind);  // its copies have landed: a failure there is theirs
    if (!s.ok()) return s;
    if (!waited.ok()) return with_context(waited, "restoring backups");
  }
  if (!checks_wake(a)) return Status::Ok();
  Status s = backend_->mark_copies(a.device, &behind->mark);
  if (!s.ok()) return s;
  *behind = WakeCheckBehind{&a, restored, behind->mark, true};
  return Status::Ok();
}

Status Saver::drop_wake_mark(WakeCheckBehind* behind) {
  if (!behind->marked) return Status::Ok();
  behind->marked = false;
  return backend_->wait_copy_mark(behind->a->device, behind->mark);
}

Status Saver::check_wake(const std::vector<Allocation*>& batch) {
  for (Allocation* a : batch) {
    if (!checks_wake(*a)) continue;
    Status s = check_wake_chunks(*a, a->wake.fingerprints.size(), nullptr);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

void Saver::note_wake_checks(const std::vector<Allocation*>& batch) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<TagInfo*, WakeCheck> verdicts;
  for (Allocation* a : batch) {
    WakeCheck& verdict = verdicts.emplace(a->tag_info, WakeCheck::kNever).first->second;
    if (a->wake.unchecked || (!a->wake.fingerprints.empty() && !checks_wake(*a))) {
      verdict = WakeCheck::kUnchecked;
    } else if (!a->wake.fingerprints.empty() && verdict == WakeCheck::kNever) {
      verdict = WakeCheck::kPassed;
    }
    a->wake.fingerprints = std::vector<Fingerprint>();  // checked: not needed again
    a->soft.copy_at = 0;
  }
  for (const auto& [info, verdict] : verdicts) {
    if (verdict != WakeCheck::kNever) info->last_wake_check = verdict;
  }
}

}  // namespace tmsl
