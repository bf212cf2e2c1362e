// What the saver knows of one tag (its catalogue entry, TagInfo) and the modes it records: what
// its last wake check found, and what a stray access to its paused memory meets. The saver's
// table lock guards every entry (core/saver.h); the features read the tag's own options here.
#pragma once

#include <cstddef>
#include <map>

#include "platform/backup_choice.h"
#include "platform/options.h"

namespace tmsl {

// What a tag's last resume found when it checked the restored bytes against the fingerprints
// its pause took (core/wake_checks.cpp). kUnchecked: some backed-up bytes were not checked
// (the check is off, or the device cannot fingerprint); kNever: no resume restored content.
enum class WakeCheck { kNever, kPassed, kFailed, kUnchecked };

// What happens to a stray access to paused memory without a backup (core/stray_catcher.h):
// kOff: nothing maps it (the raw behaviour: the GPU reports an illegal address); kWarn and
// kRaise: the scratch takes it, and the resume warns, or raises, naming the tag (the Python
// side does either; both are the same here).
enum class StrayMode { kOff = 0, kWarn = 1, kRaise = 2 };

// What the saver knows of one tag: its catalogue entry, created by the first region or
// allocation that names it.
struct TagInfo {
  // The first explicit host-backup choice (kOn or kOff; kAuto until one): what its regions
  // that give none follow.
  BackupChoice backup = BackupChoice::kAuto;
  bool graph_memory = false;  // a CUDA graph was captured into it
  bool paused = false;        // paused and not resumed since
  // Wall time of the last successful pause / resume call that released / restored memory of
  // the tag (the whole call, every tag it moved together); negative until there was one.
  double last_pause_seconds = -1;
  double last_resume_seconds = -1;
  WakeCheck last_wake_check = WakeCheck::kNever;
  // Its own values of the options of kTagScope (set_tag_option), each read by the feature
  // that obeys it: whether its wakes are checked, whether its backups may stay in the host cache
  // after a resume ("pinned"; "mmap": host memory comes back at every resume unless
  // retain_cpu_backup is set), its stray access mode, whether its pauses are soft.
  TagOptionValues options;
  // The StrayMode in effect when its last pause began (-1: never paused): what its resume tells
  // the writes found by, as that pause promised, whatever the mode was set to meanwhile.
  int paused_stray_mode = -1;
  // Writes found in the scratch while its memory without a backup was covered: the checks
  // that found some (each counts every tag then covered on the device), by device, and in all
  // since the last take_stray_writes.
  std::map<int, size_t> stray_writes;
  size_t stray_writes_unreported = 0;
  bool backs_up() const {
    return backup == BackupChoice::kOn || (backup == BackupChoice::kAuto && graph_memory);
  }
};

}  // namespace tmsl
