// One allocation's row in the saver's table: what every allocation has (address, size, device,
// tag, state, backup choice, physical memory) and one record per feature that follows it
// through its pauses, each written only by that feature (and read by the pipeline that calls
// it). A record is written by the pause or resume that has claimed the allocation (state
// kPausing or kResuming), or under the saver's table lock. Its copies, host and disk, are the
// tiers' (tiers/host_copies.h, tiers/disk_copies.h), by address.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/mapping.h"
#include "core/tag_info.h"
#include "core/wake_record.h"
#include "platform/backup_choice.h"
#include "tiers/backup.h"

namespace tmsl {

enum class AllocationState { kActive, kPausing, kPaused, kResuming };

// The records of the features that are not objects of their own yet (the Saver's members in
// the files named); the wake check's is core/wake_record.h's.
//
// The stray catcher (stray_writes.cpp).
struct StrayRecord {
  bool catches = false;  // its tag's StrayMode is not kOff (when a pause or resume claimed it)
  bool covered = false;  // paused with the scratch mapped over it (written under op_mu_)
};
// Soft pauses (soft_pause.cpp).
struct SoftRecord {
  bool pauses = false;  // its tag's soft pause (when a pause or resume claimed it)
  // While paused: its host copy (a soft arena), mapped at its address. Held here too, so the
  // copy's memory never goes while mapped there.
  std::shared_ptr<HostArena> arena;
  // Mid-resume: where the soft copy it restores from lies (for the wake check's second look),
  // and the bytes from its start the copy is off its address already (piece by piece).
  uintptr_t copy_at = 0;
  size_t unmapped = 0;
  // Mid-pause: its device memory mapped here too, the source of its copy, so that its own
  // address can map the soft copy while the copy still runs (soft_swap).
  uintptr_t alias = 0;
};
// Sharing ahead (share_ahead.cpp).
struct AheadRecord {
  bool sharing = false;  // its backup is being made ahead: a free waits
};
// The disk tier's spill (disk_backups.cpp).
struct DiskMark {
  // Marked for the disk tier by the pause's choose_spill (judged afresh at each pause, the
  // choice the tiers'; dropped once resumed, and by a pause while no directory is set).
  bool marked = false;
};

struct Allocation {
  uintptr_t va = 0;
  size_t size = 0;  // reserved = mapped bytes, a multiple of the granularity
  size_t requested = 0;  // the bytes asked for: what a backup holds (rounded to whole pages)
  int device = 0;
  std::string tag;
  TagInfo* tag_info = nullptr;  // its tag's entry in the saver's catalogue (never erased), read under its lock
  BackupChoice choice = BackupChoice::kAuto;  // its region's
  bool backup = false;  // whether the pause that claimed it copies it out (backs_up())
  AllocationState state = AllocationState::kActive;
  Pieces physical;      // while active; mid-resume, the pieces mapped so far
  WakeRecord wake;
  StrayRecord stray;
  SoftRecord soft;
  AheadRecord ahead;
  DiskMark disk;

  BackupChoice effective_choice() const { return disk.marked ? BackupChoice::kDisk : choice; }
  // Whether its pause keeps its content: a host copy, or disk files (its region's or the spill's).
  bool copied() const { return backup || effective_choice() == BackupChoice::kDisk; }
  // The bytes a backup holds: what was asked for, to whole host pages; the rest of the
  // last granule was never the caller's.
  size_t backup_bytes() const { return std::min(size, (requested + kPageBytes - 1) / kPageBytes * kPageBytes); }
  static constexpr size_t kPageBytes = 4096;
  // Whether a pause copies it to host memory: its own choice, else its tag's.
  bool backs_up() const {
    switch (effective_choice()) {
      case BackupChoice::kOn:
      case BackupChoice::kOnUncached: return true;
      case BackupChoice::kOff:
      case BackupChoice::kDisk: return false;
      case BackupChoice::kAuto: break;
    }
    return tag_info->backs_up();
  }
};


}  // namespace tmsl
