// The one table of the library's switches a program may set: each row gives a switch's name
// (the Python attribute, the C ABI's option name), the kind of its value, where it may be set,
// its environment variables (ours, and torch_memory_saver's where it has one), its default
// and its default under TMSL_LIKE_TORCH_MEMORY_SAVER. From it come the process defaults the
// environment gives (environment.cpp), a saver's values (OptionValues, below), the C ABI's one
// get/set pair and its list of options (tmsl_set_option, tmsl_get_option, tmsl_options), and
// the Python descriptors (torch_mem_saver_lite/options.py). Adding a switch is one row here,
// the code that obeys it, and its Python descriptor with its documentation.
//
// Values travel as text in the grammar of environment.h, one per kind:
//   flag   0, 1, false or true, in any case (read back as 0 or 1)
//   size   a whole number of bytes, optionally followed by K, M, G or T (read back as digits)
//   stray  off, warn or raise (StrayMode's order), in any case
//   path   any text (an empty one: none)
// Where it may be set (scopes, or-ed): kSaver, each saver holds its value, starting from the
// process default; kTag, a tag's regions may choose their own (unset: the saver's); kNode, one
// value for every process of the node (the node's ledger holds it).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "platform/status.h"

namespace tmsl {

enum class OptionKind { kFlag, kSize, kStray, kPath };
enum OptionScope : unsigned { kSaverScope = 1, kTagScope = 2, kNodeScope = 4 };

//   X(id, name, kind, scopes, variable, torch_memory_saver's variable, default, like torch_memory_saver)
// "auto" as a default: computed where the switch is obeyed (host_cache_bytes: an eighth of the
// host memory this process may use, at most 32 GiB: BackupTiers::default_cache_bytes).
#define TMSL_OPTIONS(X)                                                                                      \
  X(kMemoryMarginBytes, "memory_margin_bytes", kSize, kSaverScope, "", "", "0", "0")                        \
  X(kRetainCpuBackup, "retain_cpu_backup", kFlag, kSaverScope, "TMSL_RETAIN_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP", \
    "0", "0")                                                                                                \
  X(kHostCacheBytes, "host_cache_bytes", kSize, kSaverScope, "", "", "auto", "0")                            \
  X(kPoisonOnResume, "poison_on_resume", kFlag, kSaverScope, "TMSL_POISON_ON_RESUME", "", "0", "0")          \
  X(kVerifyWake, "verify_wake", kFlag, kSaverScope | kTagScope, "TMSL_VERIFY_WAKE", "", "1", "0")             \
  X(kStrayAccess, "stray_access", kStray, kSaverScope | kTagScope, "TMSL_STRAY_ACCESS", "", "warn", "off")    \
  X(kSoftPause, "soft_pause", kFlag, kSaverScope | kTagScope, "TMSL_SOFT_PAUSE", "", "0", "0")                \
  X(kCachesBackups, "caches_backups", kFlag, kTagScope, "", "", "1", "1")                                    \
  X(kDiskBackupDir, "disk_backup_dir", kPath, kSaverScope, "TMSL_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR", "",  \
    "")                                                                                                      \
  X(kHostMemoryBudget, "host_memory_budget", kSize, kNodeScope, "TMSL_HOST_MEMORY_BUDGET", "", "0", "0")

enum class Option : int {
#define TMSL_OPTION_ENUM(id, ...) id,
  TMSL_OPTIONS(TMSL_OPTION_ENUM)
#undef TMSL_OPTION_ENUM
};
constexpr size_t kOptionCount = 0
#define TMSL_OPTION_COUNT(...) +1
    TMSL_OPTIONS(TMSL_OPTION_COUNT)
#undef TMSL_OPTION_COUNT
    ;

struct OptionRow {
  Option id;
  const char* name;
  OptionKind kind;
  unsigned scopes;
  const char* variable;       // "": none
  const char* tms_variable;   // torch_memory_saver's name for it ("": none)
  const char* fallback;       // the default
  const char* like_tms;       // the default under TMSL_LIKE_TORCH_MEMORY_SAVER
};

// The grammar of environment.h, one function per form (false: not of that form), for the
// environment's variables and the options' values alike.
// ASCII letters in lower case (the grammar takes names in any case).
std::string lower(std::string text);
bool parse_flag(const std::string& text, bool* out);
bool parse_whole_number(const std::string& text, size_t* out);
bool parse_size(const std::string& text, size_t* out);

const OptionRow& option_row(Option id);
// The row named `name`, else kInvalidArgument naming the options there are.
Status find_option(const std::string& name, const OptionRow** out);
// "name\tkind\tscopes\tvariable\ttms_variable\tdefault\tlike_tms\n" per row, in table order:
// what tmsl_options hands to Python.
std::string option_table_text();
const char* option_kind_name(OptionKind kind);
// What a value of the kind must be, for error messages ("0, 1, false or true").
std::string option_takes(OptionKind kind);

// `text` as a number of the row's kind (flag: 0 or 1; stray: StrayMode's index), else
// kInvalidArgument naming the option, the text and what it takes. Not for kPath.
Status parse_option(const OptionRow& row, const std::string& text, uint64_t* out);
// A number of the row's kind as the text parse_option takes back.
std::string format_option(const OptionRow& row, uint64_t value);

// A saver's values of the numeric options, each read and written atomically (the hot path
// reads them without a lock); rows it does not hold (kPath, kTagScope only, kNodeScope, "auto")
// are kept by whoever obeys them.
class OptionValues {
 public:
  // The table's defaults (not the environment's: whoever makes a saver hands those over).
  OptionValues();
  uint64_t get(Option id) const { return values_[static_cast<size_t>(id)].load(std::memory_order_relaxed); }
  bool flag(Option id) const { return get(id) != 0; }
  void set(Option id, uint64_t value) { values_[static_cast<size_t>(id)].store(value, std::memory_order_relaxed); }

 private:
  std::array<std::atomic<uint64_t>, kOptionCount> values_{};
};

// Whether a saver holds the row's value itself in OptionValues.
bool saver_holds(const OptionRow& row);
// The row's default as a number (its kind's; 0 for kPath and "auto").
uint64_t option_default(Option id);

// A tag's own values of the options of kTagScope, by option: none where its regions chose
// none (or "" set it back). What none means is the obeyer's, as with the saver's values: the
// saver's value (stray_access, soft_pause), or the option's default (verify_wake and
// caches_backups, which a tag turns off beside the saver's). Read and written under the
// saver's table lock, as the rest of the tag's entry.
class TagOptionValues {
 public:
  TagOptionValues() { own_.fill(kNone); }
  bool has(Option id) const { return own_[static_cast<size_t>(id)] != kNone; }
  uint64_t get(Option id) const { return static_cast<uint64_t>(own_[static_cast<size_t>(id)]); }
  // Its own value, else `otherwise`.
  uint64_t value_or(Option id, uint64_t otherwise) const { return has(id) ? get(id) : otherwise; }
  void set(Option id, uint64_t value) { own_[static_cast<size_t>(id)] = static_cast<int64_t>(value); }
  void clear(Option id) { own_[static_cast<size_t>(id)] = kNone; }

 private:
  static constexpr int64_t kNone = -1;
  std::array<int64_t, kOptionCount> own_{};
};

}  // namespace tmsl
