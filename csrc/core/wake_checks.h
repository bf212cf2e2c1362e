// Verified wakes: a pause fingerprints each backed-up allocation where it lies (on its GPU,
// beside the copies), and the resume fingerprints the restored bytes and compares, so a backup
// changed or damaged while paused (host memory written by mistake, a disk file, a store chunk)
// fails the resume instead of waking an engine on wrong bytes. The fingerprint is the content
// store's (platform/fingerprint.h): 2^-127 for two different chunks to match. WakeChecks is
// the feature, WakeRecord its record in each allocation's row (core/wake_record.h); the saver's
// pipeline calls it at its stages and decides what a differing chunk is (a soft pause's kept
// write, else a failed resume).
#pragma once

#include <cstddef>
#include <map>
#include <utility>
#include <vector>

#include "core/tag_info.h"
#include "core/wake_record.h"
#include "platform/backend.h"
#include "platform/fingerprint.h"
#include "platform/options.h"
#include "platform/status.h"
#include "tiers/backup_tiers.h"

namespace tmsl {

struct Allocation;

class WakeChecks {
 public:
  // `options`: the saver's (verify_wake, read at each pause and resume); the tiers make the
  // fingerprints. (Both outlive it; neither is used before the first pause.)
  WakeChecks(Backend& backend, BackupTiers& tiers, const OptionValues& options)
      : backend_(backend), tiers_(tiers), options_(options) {}

  // Whether a tag's wakes are checked: a tag only turns its checks off (none of its own: on).
  static bool checked_for(const TagInfo& info);
  // Whether the check is on for the saver and a's tag (as its pause or resume found the tag).
  bool on(const Allocation& a) const;
  // Whether a's resume checks it now: it has fingerprints and the check is on (turned off
  // after the pause: its backup is taken as it is).
  bool checks(const Allocation& a) const;

  // At a pause, once its copies are queued: fingerprints under `key` the batch's allocations
  // with a copy and none yet (a content copy has its chunks'), beside the copies (the devices
  // are idle: nothing else writes there); one it cannot check is noted unchecked.
  Status fingerprint_pause(const std::vector<Allocation*>& batch, const FingerprintKey& key);
  // At a resume: fingerprints a's restored chunks [checked_chunks, end) (after `after`, where
  // given); each whose bytes differ from its pause's goes to *differing as (chunk, restored
  // fingerprint), for the caller to judge (accept, or mismatch).
  Status compare(Allocation& a, size_t end, const CopyMark* after, std::vector<std::pair<size_t, Fingerprint>>* differing);
  // Chunk k's restored bytes taken as its content (a write a soft pause kept).
  static void accept(Allocation& a, size_t k, const Fingerprint& restored);
  // a's chunks before `end` checked.
  static void checked_up_to(Allocation& a, size_t end);
  // kContentMismatch for a's chunk k, restored with bytes other than its pause saw: nothing
  // was woken, and what to do.
  static Status mismatch(const Allocation& a, size_t k);
  // The check behind the copies: a mark after a's bytes [0, restored), where a is checked
  // (the caller checks the earlier allocation's chunks first). drop_mark: the mark, waited for.
  Status mark_behind(Allocation& a, size_t restored, WakeCheckBehind* behind);
  Status drop_mark(WakeCheckBehind* behind);
  // A resume's verdict for its tags (kNever where it restored no content), once it succeeded;
  // the fingerprints are let go (not needed again).
  std::map<TagInfo*, WakeCheck> verdicts(const std::vector<Allocation*>& batch) const;

 private:
  Backend& backend_;
  BackupTiers& tiers_;
  const OptionValues& options_;
};

}  // namespace tmsl
