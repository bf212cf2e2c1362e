// The wake check's work (core/wake_checks.h): fingerprints at a pause, the comparison at a
// resume, the verdicts.
#include <algorithm>

#include "core/wake_checks.h"

#include "core/allocation.h"

namespace tmsl {

namespace {

// "0x7f00.. (+64.00 MiB .. +128.00 MiB)": where in an allocation a chunk lies.
std::string chunk_range(uintptr_t va, size_t chunk, size_t bytes) {
  const size_t from = chunk * HostArena::kRangeBytes;
  return "bytes " + format_bytes(from) + " to " + format_bytes(std::min(bytes, from + HostArena::kRangeBytes)) +
         " of it (from " + format_address(va + from) + ")";
}

}  // namespace

bool WakeChecks::checked_for(const TagInfo& info) {
  return info.options.value_or(Option::kVerifyWake, option_default(Option::kVerifyWake)) != 0;
}

bool WakeChecks::on(const Allocation& a) const { return options_.flag(Option::kVerifyWake) && a.wake.verify; }

bool WakeChecks::checks(const Allocation& a) const { return !a.wake.fingerprints.empty() && on(a); }

Status WakeChecks::fingerprint_pause(const std::vector<Allocation*>& batch, const FingerprintKey& key) {
  for (Allocation* a : batch) {
    if (!a->copied() || !a->wake.fingerprints.empty()) continue;  // (content copies: theirs)
    a->wake.unchecked = !on(*a) || !fingerprintable(a->backup_bytes());
    if (a->wake.unchecked) continue;
    Status s = tiers_.fingerprint_chunks(a->device, a->va, a->backup_bytes(), key, &a->wake.fingerprints);
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
    a->wake.key = &key;
  }
  return Status::Ok();
}

Status WakeChecks::compare(Allocation& a, size_t end, const CopyMark* after,
                           std::vector<std::pair<size_t, Fingerprint>>* differing) {
  differing->clear();
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
    if (!(restored[k - first] == a.wake.fingerprints[k])) differing->emplace_back(k, restored[k - first]);
  }
  return Status::Ok();
}

void WakeChecks::accept(Allocation& a, size_t k, const Fingerprint& restored) { a.wake.fingerprints[k] = restored; }

void WakeChecks::checked_up_to(Allocation& a, size_t end) { a.wake.checked_chunks = std::max(a.wake.checked_chunks, end); }

Status WakeChecks::mismatch(const Allocation& a, size_t k) {
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

Status WakeChecks::mark_behind(Allocation& a, size_t restored, WakeCheckBehind* behind) {
  if (!checks(a)) return Status::Ok();
  Status s = backend_.mark_copies(a.device, &behind->mark);
  if (!s.ok()) return s;
  *behind = WakeCheckBehind{&a, restored, behind->mark, true};
  return Status::Ok();
}

Status WakeChecks::drop_mark(WakeCheckBehind* behind) {
  if (!behind->marked) return Status::Ok();
  behind->marked = false;
  return backend_.wait_copy_mark(behind->a->device, behind->mark);
}

std::map<TagInfo*, WakeCheck> WakeChecks::verdicts(const std::vector<Allocation*>& batch) const {
  std::map<TagInfo*, WakeCheck> verdicts;
  for (Allocation* a : batch) {
    WakeCheck& verdict = verdicts.emplace(a->tag_info, WakeCheck::kNever).first->second;
    if (a->wake.unchecked || (!a->wake.fingerprints.empty() && !checks(*a))) {
      verdict = WakeCheck::kUnchecked;
    } else if (!a->wake.fingerprints.empty() && verdict == WakeCheck::kNever) {
      verdict = WakeCheck::kPassed;
    }
    a->wake.fingerprints = std::vector<Fingerprint>();  // checked: not needed again
  }
  return verdicts;
}

}  // namespace tmsl
