#include "platform/environment.h"

#include "platform/options.h"
#include "platform/tag_rules.h"

#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <vector>

namespace tmsl {
namespace {

std::string trimmed(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\n\r");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t\n\r") - first + 1);
}

// A variable's value, trimmed; "" when unset or empty.
std::string value_of(const char* name) {
  const char* value = getenv(name);
  return value == nullptr ? std::string() : trimmed(value);
}

void note(std::string* error, const std::string& what) {
  *error += (error->empty() ? "" : "; ") + what;
}

// Turns a value's text into the setting (false: not of the setting's form).
template <typename T>
using Parser = std::function<bool(const std::string&, T*)>;

// One setting under our name and torch_memory_saver's (`theirs` nullptr: ours only): each
// set one must parse, and both set must mean the same. *name: the variable it came from
// (nullptr: neither set, *out untouched). False, with a note naming the variable, the value
// and `takes`, for a bad value or two that disagree.
template <typename T>
bool read_setting(const char* ours, const char* theirs, const Parser<T>& parse, const std::string& takes,
                  T* out, const char** name, std::string* error) {
  *name = nullptr;
  bool ok = true, found = false;
  T first{};
  std::string first_text;
  for (const char* variable : {ours, theirs}) {
    if (variable == nullptr) continue;
    const std::string text = value_of(variable);
    if (text.empty()) continue;
    T value{};
    if (!parse(text, &value)) {
      note(error, std::string(variable) + " must be " + takes + ", got '" + getenv(variable) + "'");
      ok = false;
    } else if (found && !(value == first)) {
      note(error, std::string(ours) + "='" + first_text + "' and " + variable + "='" + text +
                      "' disagree; set one of them");
      ok = false;
    } else if (!found) {
      found = true;
      first = value;
      first_text = text;
      *name = variable;
    }
  }
  if (ok && found) *out = first;
  if (!ok) *name = nullptr;
  return ok;
}

bool read_flag(const char* ours, const char* theirs, bool* out, bool* given, std::string* error) {
  const char* name = nullptr;
  const bool ok = read_setting<bool>(ours, theirs, parse_flag, "0, 1, false or true", out, &name, error);
  if (given != nullptr) *given = name != nullptr;
  return ok;
}

Parser<size_t> whole_number_from(size_t lowest, size_t highest) {
  return [=](const std::string& text, size_t* out) {
    return parse_whole_number(text, out) && *out >= lowest && *out <= highest;
  };
}

// A choice among `names` (in any case): its index.
Parser<size_t> choice_of(std::initializer_list<const char*> names) {
  std::vector<std::string> kept(names.begin(), names.end());
  return [kept](const std::string& text, size_t* out) {
    for (size_t i = 0; i < kept.size(); ++i) {
      if (lower(text) == kept[i]) {
        *out = i;
        return true;
      }
    }
    return false;
  };
}

// The defaults of the options a saver holds itself (options.h), each from its variables,
// else the table's default (torch_memory_saver's under the switch, read before).
bool read_saver_options(ProcessDefaults* d) {
  bool ok = true;
  for (size_t i = 0; i < kOptionCount; ++i) {
    const OptionRow& row = option_row(static_cast<Option>(i));
    if (!saver_holds(row)) continue;
    uint64_t value = 0;
    parse_option(row, d->like_torch_memory_saver ? row.like_tms : row.fallback, &value);
    if (*row.variable != '\0') {
      const Parser<uint64_t> parse = [&row](const std::string& text, uint64_t* out) {
        return parse_option(row, text, out).ok();
      };
      const char* name = nullptr;
      ok = read_setting<uint64_t>(row.variable, *row.tms_variable != '\0' ? row.tms_variable : nullptr, parse,
                                 option_takes(row.kind), &value, &name, &d->error) && ok;
    }
    d->saver_options[i] = value;
  }
  return ok;
}

ProcessDefaults read_process_defaults() {
  ProcessDefaults d;
  std::string& error = d.error;
  bool given = false;
  // First: it sets the defaults the variables below may still override.
  bool ok = read_flag("TMSL_LIKE_TORCH_MEMORY_SAVER", nullptr, &d.like_torch_memory_saver, nullptr, &error);
  if (d.like_torch_memory_saver) {
    d.keeps_host_cache = false;
    d.host_memory_budget_applies = false;
    d.share_backups = false;
  }
  ok = read_flag("TMSL_REGION_ALL_THREADS", "TMS_INIT_ENABLE", &d.all_threads, nullptr, &error) && ok;
  bool backup = false;
  if (read_flag("TMSL_DEFAULT_CPU_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP", &backup, &given, &error)) {
    if (given) d.backup = backup ? BackupChoice::kOn : BackupChoice::kOff;
  } else {
    ok = false;
  }
  bool disk = false;
  if (read_flag("TMSL_DEFAULT_DISK_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP", &disk, nullptr, &error)) {
    if (disk && d.backup == BackupChoice::kOn) {
      note(&error, "disk backup and CPU backup of the default region exclude each other");
      ok = false;
    } else if (disk) {
      d.backup = BackupChoice::kDisk;
    }
  } else {
    ok = false;
  }
  size_t backend = 0;  // 0: pinned, 1: mmap
  const char* name = nullptr;
  if (read_setting("TMSL_DEFAULT_CPU_BACKUP_BACKEND", "TMS_INIT_CPU_BACKUP_BACKEND", choice_of({"pinned", "mmap"}),
                   "one of pinned, mmap", &backend, &name, &error)) {
    if (backend == 1) {
      d.caches_backups = false;
      if (d.backup == BackupChoice::kOn) d.backup = BackupChoice::kOnUncached;
    }
  } else {
    ok = false;
  }
  ok = read_saver_options(&d) && ok;
  // A path is taken as it is (spaces included): only its length is checked here.
  std::string dir;
  const Parser<std::string> any_path = [](const std::string& text, std::string* out) {
    *out = text;
    return true;
  };
  if (read_setting("TMSL_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR", any_path, "a path", &dir, &name, &error)) {
    if (name != nullptr && strlen(getenv(name)) >= kMaxDiskBackupDirBytes) {
      note(&error, std::string(name) + " is longer than " + std::to_string(kMaxDiskBackupDirBytes - 1) + " bytes");
      ok = false;
    } else if (name != nullptr) {
      d.disk_backup_dir_variable = name;
      d.disk_backup_dir = getenv(name);
    }
  } else {
    ok = false;
  }
  const char* tag = getenv("TMSL_DEFAULT_TAG");  // taken as it is, spaces included
  if (tag != nullptr && *tag != '\0') {
    Status valid = check_tag(tag);
    if (!valid.ok()) {
      note(&error, "TMSL_DEFAULT_TAG: " + valid.message());
      ok = false;
    } else {
      d.tag = tag;
    }
  }
  ok = read_flag("TMSL_SHARE_BACKUPS", nullptr, &d.share_backups, &d.share_backups_given, &error) && ok;
  ok = read_flag("TMSL_LOG_ALLOCATIONS", nullptr, &d.log_allocations, nullptr, &error) && ok;
  const Parser<size_t> size = [](const std::string& text, size_t* out) { return parse_size(text, out) && *out > 0; };
  if (!read_setting("TMSL_HOST_MEMORY_BUDGET", nullptr, size,
                    "a size in bytes above 0: a whole number, optionally followed by K, M, G or T "
                    "(powers of 1024), such as 64G",
                    &d.host_memory_budget, &name, &d.host_memory_budget_error)) {
    note(&error, d.host_memory_budget_error);
    ok = false;
  } else if (name != nullptr) {
    d.host_memory_budget_applies = true;  // a budget of its own: also under the switch
  }
  const char* ledger = getenv("TMSL_HOST_LEDGER");  // a path, taken as it is
  if (ledger != nullptr) d.host_ledger = ledger;
  if (!ok) d.all_threads = false;
  return d;
}

}  // namespace

const ProcessDefaults& process_defaults() {
  static const ProcessDefaults* defaults = new ProcessDefaults(read_process_defaults());
  return *defaults;
}

Status disk_backup_settings(size_t* chunk_bytes, size_t* workers) {
  std::string error;
  const char* name = nullptr;
  size_t chunk_mib = kDefaultDiskChunkMiB;
  *workers = kDefaultDiskWorkers;
  read_setting("TMSL_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB", whole_number_from(1, kMaxDiskChunkMiB),
               "a whole number of MiB from 1 to " + std::to_string(kMaxDiskChunkMiB), &chunk_mib, &name, &error);
  read_setting("TMSL_DISK_BACKUP_WORKERS", nullptr, whole_number_from(1, kMaxDiskWorkers),
               "a whole number from 1 to " + std::to_string(kMaxDiskWorkers), workers, &name, &error);
  if (!error.empty()) return Status::Error(Code::kInvalidArgument, error);
  *chunk_bytes = chunk_mib << 20;
  return Status::Ok();
}

std::string cuda_driver_library() {
  const char* path = getenv("TMSL_CUDA_DRIVER_LIBRARY");
  return path != nullptr && *path != '\0' ? path : "libcuda.so.1";
}

}  // namespace tmsl
