// The saver's tag catalogue: the tags regions and allocations named, their backup choice and
// flags, and which tags a selection covers. Under mu_, as the table.
#include "core/saver.h"

#include "platform/tag_rules.h"

namespace tmsl {

Status tag_paused_error(const std::string& tag) {
  return Status::Error(Code::kTagPaused, "tag '" + tag + "' is paused; resume it before allocating in it (a new "
                                         "tensor could be placed in its released memory)");
}

namespace {
// The tag-wide host-backup choice an explicit region choice stands for (kAuto: none).
BackupChoice host_backup_of(BackupChoice choice) {
  switch (choice) {
    case BackupChoice::kOn:
    case BackupChoice::kOnUncached: return BackupChoice::kOn;
    case BackupChoice::kOff:
    case BackupChoice::kDisk: return BackupChoice::kOff;  // no host copy asked for
    case BackupChoice::kAuto: break;
  }
  return BackupChoice::kAuto;
}
}  // namespace

Status Saver::admit_name(const std::string& tag, TagInfo** entry, bool* is_new) {
  auto [it, added] = tags_.try_emplace(tag);
  if (added) {
    // Every way in (torch_memory_saver's tms_set_current_tag included) meets the one rule.
    Status valid = check_tag(tag.data(), tag.size());
    if (!valid.ok()) {
      tags_.erase(it);
      return valid;
    }
  }
  *entry = &it->second;
  if (is_new != nullptr) *is_new = added;
  return Status::Ok();
}

Status Saver::admit(const std::string& tag, BackupChoice backup, TagInfo** entry) {
  TagInfo* found = nullptr;
  bool is_new = false;
  Status s = admit_name(tag, &found, &is_new);
  if (!s.ok()) return s;
  TagInfo& info = *found;
  if (entry != nullptr) *entry = &info;
  if (!is_new && info.paused) return tag_paused_error(tag);
  // Each allocation keeps its own region's choice; the tag keeps the first explicit one, for
  // the regions of it that give none.
  if (info.backup == BackupChoice::kAuto) info.backup = host_backup_of(backup);
  return Status::Ok();
}

Status Saver::enter_tag(const std::string& tag, BackupChoice backup) {
  std::lock_guard<std::mutex> lock(mu_);
  return admit(tag, backup);
}

Status Saver::mark_graph_memory(const std::string& tag) {
  std::lock_guard<std::mutex> lock(mu_);
  TagInfo* info = nullptr;
  Status s = admit_name(tag, &info);
  if (s.ok()) info->graph_memory = true;
  return s;
}

bool Saver::tag_info(const std::string& tag, TagInfo* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tags_.find(tag);
  if (it == tags_.end()) return false;
  *out = it->second;
  return true;
}

Status Saver::set_tag(const std::string& tag, const std::function<void(TagInfo&)>& set) {
  std::lock_guard<std::mutex> lock(mu_);
  TagInfo* info = nullptr;
  Status s = admit_name(tag, &info);  // enters the tag, as a region would
  if (s.ok()) set(*info);
  return s;
}

Status Saver::set_tag_option(const std::string& tag, const OptionRow& row, const std::string& text) {
  if (!(row.scopes & kTagScope)) {
    return Status::Error(Code::kInvalidArgument,
                         std::string("option '") + row.name + "' is not a tag's: set it on the saver");
  }
  uint64_t value = 0;
  Status s = text.empty() ? Status::Ok() : parse_option(row, text, &value);
  if (!s.ok()) return s;
  return set_tag(tag, [&row, &text, value](TagInfo& info) {
    if (text.empty()) {
      info.options.clear(row.id);  // the saver's value, or the default, again
    } else {
      info.options.set(row.id, value);
    }
  });
}

Status Saver::tag_option(const std::string& tag, const OptionRow& row, std::string* out) const {
  if (!(row.scopes & kTagScope)) {
    return Status::Error(Code::kInvalidArgument, std::string("option '") + row.name + "' is not a tag's");
  }
  TagInfo info;
  if (!tag_info(tag, &info)) return Status::Error(Code::kInvalidArgument, "unknown tag '" + tag + "': no region has used it");
  *out = info.options.has(row.id) ? format_option(row, info.options.get(row.id)) : std::string();
  return Status::Ok();
}

Status Saver::set_option(const OptionRow& row, const std::string& text) {
  if (!(row.scopes & kSaverScope)) {
    return Status::Error(Code::kInvalidArgument, std::string("option '") + row.name + "' is not a saver's");
  }
  if (row.id == Option::kDiskBackupDir) return set_disk_directory(text);
  uint64_t value = 0;
  Status s = parse_option(row, text, &value);
  if (!s.ok()) return s;
  if (row.id == Option::kHostCacheBytes) {
    set_host_cache_bytes(static_cast<size_t>(value));
  } else {
    options_.set(row.id, value);
  }
  return Status::Ok();
}

Status Saver::option(const OptionRow& row, std::string* out) const {
  if (!(row.scopes & kSaverScope)) {
    return Status::Error(Code::kInvalidArgument, std::string("option '") + row.name + "' is not a saver's");
  }
  if (row.id == Option::kDiskBackupDir) {
    *out = disk_directory();
  } else if (row.id == Option::kHostCacheBytes) {
    *out = std::to_string(host_cache_bytes());
  } else {
    *out = format_option(row, options_.get(row.id));
  }
  return Status::Ok();
}

std::vector<Saver::Range> Saver::allocations_of(const std::string& tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Range> out;
  for (const auto& entry : table_) {
    const Allocation& a = entry.second;
    if (a.tag == tag) out.push_back(Range{a.va, a.size, a.device, a.effective_choice()});
  }
  return out;
}

Status Saver::check_known(const TagSelection& selection) const {
  for (const std::string& tag : selection.tags) {
    if (selection.all || tags_.count(tag) != 0) continue;
    std::string known;
    for (const auto& entry : tags_) known += (known.empty() ? "'" : ", '") + entry.first + "'";
    return Status::Error(Code::kInvalidArgument,
                         "unknown tag '" + tag + "': no region has used it; known tags: " +
                             (known.empty() ? "none yet" : "[" + known + "]"));
  }
  return Status::Ok();
}

void Saver::set_paused(const TagSelection& selection, bool paused) {
  for (auto& entry : tags_) {
    if (selection.matches(entry.first)) entry.second.paused = paused;
  }
}

}  // namespace tmsl
