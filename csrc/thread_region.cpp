#include "thread_region.h"

#include "tag_rules.h"

#include <cstdlib>
#include <cstring>

namespace tmsl {
namespace {

// Reads a 0/1 variable into *out; false (and a note in *error) for any other value.
bool parse_flag(const char* name, bool* out, std::string* error) {
  const char* value = getenv(name);
  if (value == nullptr || *value == '\0') return true;
  if (strcmp(value, "1") == 0 || strcmp(value, "true") == 0) {
    *out = true;
  } else if (strcmp(value, "0") == 0 || strcmp(value, "false") == 0) {
    *out = false;
  } else {
    *error += std::string(error->empty() ? "" : "; ") + name + " must be 0 or 1, got '" + value + "'";
    return false;
  }
  return true;
}

// Which of our name and torch_memory_saver's for one setting is set (*name stays nullptr
// for neither); false, with a note, when both are set to different values.
bool pick(const char* ours, const char* theirs, const char** name, std::string* error) {
  const char* a = getenv(ours);
  const char* b = getenv(theirs);
  const bool has_a = a != nullptr && *a != '\0', has_b = b != nullptr && *b != '\0';
  if (has_a && has_b && strcmp(a, b) != 0) {
    *error += std::string(error->empty() ? "" : "; ") + ours + "='" + a + "' and " + theirs + "='" + b +
              "' disagree; set one of them";
    return false;
  }
  *name = has_a ? ours : has_b ? theirs : nullptr;
  return true;
}

// parse_flag over our name and torch_memory_saver's; *given tells whether either was set.
bool parse_flag_pair(const char* ours, const char* theirs, bool* out, bool* given, std::string* error) {
  const char* name = nullptr;
  if (!pick(ours, theirs, &name, error)) return false;
  *given = name != nullptr;
  return name == nullptr || parse_flag(name, out, error);
}

ProcessDefaults read_process_defaults() {
  ProcessDefaults d;
  bool given = false;
  bool ok = parse_flag_pair("TMSL_REGION_ALL_THREADS", "TMS_INIT_ENABLE", &d.all_threads, &given, &d.error);
  bool backup = false;
  if (parse_flag_pair("TMSL_DEFAULT_CPU_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP", &backup, &given, &d.error)) {
    if (given) d.backup = backup ? BackupChoice::kOn : BackupChoice::kOff;
  } else {
    ok = false;
  }
  bool disk = false;
  if (parse_flag_pair("TMSL_DEFAULT_DISK_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP", &disk, &given, &d.error)) {
    if (disk && d.backup == BackupChoice::kOn) {
      d.error += std::string(d.error.empty() ? "" : "; ") +
                 "disk backup and CPU backup of the default region exclude each other";
      ok = false;
    } else if (disk) {
      d.backup = BackupChoice::kDisk;
    }
  } else {
    ok = false;
  }
  const char* backend_name = nullptr;
  if (pick("TMSL_DEFAULT_CPU_BACKUP_BACKEND", "TMS_INIT_CPU_BACKUP_BACKEND", &backend_name, &d.error)) {
    const char* backend = backend_name != nullptr ? getenv(backend_name) : "pinned";
    if (strcmp(backend, "mmap") == 0) {
      d.caches_backups = false;
      if (d.backup == BackupChoice::kOn) d.backup = BackupChoice::kOnUncached;
    } else if (strcmp(backend, "pinned") != 0) {
      d.error += std::string(d.error.empty() ? "" : "; ") + backend_name + " must be one of pinned, mmap, got '" +
                 backend + "'";
      ok = false;
    }
  } else {
    ok = false;
  }
  ok = parse_flag("TMSL_POISON_ON_RESUME", &d.poison_on_resume, &d.error) && ok;
  ok = parse_flag_pair("TMSL_RETAIN_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP", &d.retain_backups, &given, &d.error) && ok;
  const char* dir_name = nullptr;
  if (pick("TMSL_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR", &dir_name, &d.error)) {
    if (dir_name != nullptr && strlen(getenv(dir_name)) >= kMaxDiskBackupDirBytes) {
      d.error += std::string(d.error.empty() ? "" : "; ") + dir_name + " is longer than " +
                 std::to_string(kMaxDiskBackupDirBytes - 1) + " bytes";
      ok = false;
    } else if (dir_name != nullptr) {
      d.disk_backup_dir_variable = dir_name;
      d.disk_backup_dir = getenv(dir_name);
    }
  } else {
    ok = false;
  }
  const char* tag = getenv("TMSL_DEFAULT_TAG");
  if (tag != nullptr) {
    Status valid = check_tag(tag);
    if (!valid.ok()) {
      d.error += std::string(d.error.empty() ? "" : "; ") + "TMSL_DEFAULT_TAG: " + valid.message();
      ok = false;
    } else {
      d.tag = tag;
    }
  }
  if (!ok) d.all_threads = false;
  return d;
}

}  // namespace

ThreadRegion& thread_region() {
  static thread_local ThreadRegion region;
  return region;
}

const ProcessDefaults& process_defaults() {
  static const ProcessDefaults* defaults = new ProcessDefaults(read_process_defaults());
  return *defaults;
}

const ThreadRegion& effective_region() {
  const ThreadRegion& region = thread_region();
  if (region.saver != 0 || region.explicit_none) return region;
  // The process defaults as this thread's region, filled in once the saver exists.
  static thread_local ThreadRegion from_defaults;
  const ProcessDefaults& d = process_defaults();
  if (from_defaults.saver == 0 && d.all_threads && default_saver(&from_defaults.saver).ok()) {
    from_defaults.tag = d.tag;
    from_defaults.backup = d.backup;
  }
  return from_defaults;
}

Status region_saver(const ThreadRegion& region, SaverRef* out) {
  if (in_forked_child()) return forked_child_error();
  *out = find_saver(region.saver);
  if (*out) return Status::Ok();
  return Status::Error(Code::kInvalidArgument,
                       "this thread's region (tag '" + region.tag + "') belongs to a saver that has been "
                       "closed; leave the region and enter one of a live saver");
}

}  // namespace tmsl
