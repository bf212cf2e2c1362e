// Stray access to paused memory without a backup, the saver's part (the scratch itself is
// core/stray_catcher.h): which allocations the scratch covers while paused, and for whose
// tags a write found in it is counted.
#include "core/saver.h"

namespace tmsl {

StrayMode Saver::stray_mode_of(const TagInfo& info) const {
  return static_cast<StrayMode>(info.options.value_or(Option::kStrayAccess, options_.get(Option::kStrayAccess)));
}

bool Saver::catches_strays(const TagInfo& info) const { return stray_mode_of(info) != StrayMode::kOff; }

void Saver::ready_stray_catchers(const std::vector<Allocation*>& batch) {
  for (const Allocation* a : batch) {
    if (a->stray.catches && !a->copied()) catcher_.ready_to_cover(a->device, a->size);  // a failure: it stays unmapped
  }
  note_stray_writes(devices_of(batch));
}

void Saver::note_stray_writes(const std::set<int>& devices, const Allocation* leaving) {
  for (int device : devices) {
    std::set<TagInfo*> covered;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& entry : table_) {
        if (entry.second.stray.covered && entry.second.device == device) covered.insert(entry.second.tag_info);
      }
      if (leaving != nullptr && leaving->stray.covered && leaving->device == device) covered.insert(leaving->tag_info);
    }
    if (covered.empty()) continue;
    // The stray kernels still queued write first. (A device that cannot fingerprint covers all
    // the same: harmless, but not counted.)
    bool written = false;  // (set by a check that failed midway too: what it refilled is counted)
    if (backend_->synchronize_device(device).ok()) catcher_.check(device, process_key(), &written);
    if (!written) continue;
    std::lock_guard<std::mutex> lock(mu_);
    for (TagInfo* info : covered) {
      ++info->stray_writes[device];
      ++info->stray_writes_unreported;
    }
  }
}

void Saver::cover_stray(Allocation& a) {
  // (Where an orphan is still mapped in its range, that unmap is retried first.)
  if (!a.stray.catches || a.stray.covered || a.copied() || mappings_.mapped_in(a.device, a.va, a.size)) return;
  a.stray.covered = catcher_.cover(a.device, a.va, a.size).ok();
}

Status Saver::uncover_stray(Allocation& a) {
  if (!a.stray.covered) return Status::Ok();
  a.stray.covered = false;  // unmapped now, or the orphans' to unmap
  Status s = catcher_.uncover(a.device, a.va, a.size);
  if (s.ok()) return s;
  return with_context(s, "unmapping the scratch from paused tag '" + a.tag + "' (" + format_bytes(a.size) +
                             " at " + format_address(a.va) + ")");
}

Status Saver::take_stray_writes(const std::string& tag, size_t* count, StrayMode* mode) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tags_.find(tag);
  if (it == tags_.end()) return Status::Error(Code::kInvalidArgument, "no region has used tag '" + tag + "'");
  TagInfo& info = it->second;
  *count = info.paused ? 0 : info.stray_writes_unreported;
  if (!info.paused) info.stray_writes_unreported = 0;
  // Writes are only found while paused: they are told as the pause they were made under said.
  *mode = info.paused_stray_mode >= 0 ? static_cast<StrayMode>(info.paused_stray_mode) : stray_mode_of(info);
  return Status::Ok();
}

size_t Saver::stray_tags_to_tell(const TagSelection& selection) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t count = 0;
  for (const auto& entry : tags_) {
    if (selection.matches(entry.first) && !entry.second.paused && entry.second.stray_writes_unreported != 0) ++count;
  }
  return count;
}

}  // namespace tmsl
