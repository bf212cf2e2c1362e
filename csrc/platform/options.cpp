#include "platform/options.h"

#include <cstring>


namespace tmsl {
namespace {

constexpr OptionRow kRows[] = {
#define TMSL_OPTION_ROW(id, name, kind, scopes, variable, tms_variable, fallback, like_tms) \
  {Option::id, name, OptionKind::kind, scopes, variable, tms_variable, fallback, like_tms},
    TMSL_OPTIONS(TMSL_OPTION_ROW)
#undef TMSL_OPTION_ROW
};
static_assert(sizeof(kRows) / sizeof(kRows[0]) == kOptionCount, "one row per option");

const char* const kStrayNames[] = {"off", "warn", "raise"};  // StrayMode's order

// Each kind's name (tmsl_options) and what its values must be (the errors), in OptionKind's order.
struct KindText {
  const char* name;
  const char* takes;
};
constexpr KindText kKinds[] = {
    {"flag", "0, 1, false or true"},
    {"size", "a size in bytes: a whole number, optionally followed by K, M, G or T (powers of 1024)"},
    {"stray", "one of off, warn, raise"},
    {"path", "a path"},
};

}  // namespace

std::string lower(std::string text) {
  for (char& c : text) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  return text;
}

bool parse_flag(const std::string& text, bool* out) {
  const std::string word = lower(text);
  if (word == "1" || word == "true") {
    *out = true;
  } else if (word == "0" || word == "false") {
    *out = false;
  } else {
    return false;
  }
  return true;
}

bool parse_whole_number(const std::string& text, size_t* out) {
  if (text.empty() || text.size() > 20) return false;
  unsigned long long value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    const unsigned digit = static_cast<unsigned>(c - '0');
    if (value > (~0ULL - digit) / 10) return false;  // beyond 64 bits
    value = value * 10 + digit;
  }
  *out = static_cast<size_t>(value);
  return true;
}

bool parse_size(const std::string& text, size_t* out) {
  if (text.empty()) return false;
  const char* const kSuffixes = "kmgt";
  const char* suffix = strchr(kSuffixes, lower(text.substr(text.size() - 1))[0]);
  const bool has_suffix = suffix != nullptr && *suffix != '\0';
  size_t value = 0;
  if (!parse_whole_number(has_suffix ? text.substr(0, text.size() - 1) : text, &value)) return false;
  const int shift = has_suffix ? 10 * static_cast<int>(suffix - kSuffixes + 1) : 0;
  if (shift != 0 && value > (~size_t{0} >> shift)) return false;
  *out = value << shift;
  return true;
}

std::string option_takes(OptionKind kind) { return kKinds[static_cast<size_t>(kind)].takes; }

namespace {

std::string scopes_text(unsigned scopes) {
  std::string text;
  for (const auto& [bit, name] : {std::pair<unsigned, const char*>{kSaverScope, "saver"}, {kTagScope, "tag"},
                                  {kNodeScope, "node"}}) {
    if (scopes & bit) text += (text.empty() ? "" : ",") + std::string(name);
  }
  return text;
}

}  // namespace

const OptionRow& option_row(Option id) { return kRows[static_cast<size_t>(id)]; }

Status find_option(const std::string& name, const OptionRow** out) {
  std::string names;
  for (const OptionRow& row : kRows) {
    if (name == row.name) {
      *out = &row;
      return Status::Ok();
    }
    names += (names.empty() ? "" : ", ") + std::string(row.name);
  }
  return Status::Error(Code::kInvalidArgument, "no option named '" + name + "'; the options are " + names);
}

const char* option_kind_name(OptionKind kind) { return kKinds[static_cast<size_t>(kind)].name; }

std::string option_table_text() {
  std::string text;
  for (const OptionRow& row : kRows) {
    text += std::string(row.name) + "\t" + option_kind_name(row.kind) + "\t" + scopes_text(row.scopes) + "\t" +
            row.variable + "\t" + row.tms_variable + "\t" + row.fallback + "\t" + row.like_tms + "\n";
  }
  return text;
}

Status parse_option(const OptionRow& row, const std::string& text, uint64_t* out) {
  bool flag = false;
  size_t number = 0;
  switch (row.kind) {
    case OptionKind::kFlag:
      if (parse_flag(text, &flag)) {
        *out = flag ? 1 : 0;
        return Status::Ok();
      }
      break;
    case OptionKind::kSize:
      if (parse_size(text, &number)) {
        *out = static_cast<uint64_t>(number);
        return Status::Ok();
      }
      break;
    case OptionKind::kStray:
      for (uint64_t i = 0; i < 3; ++i) {
        if (strcasecmp(text.c_str(), kStrayNames[i]) == 0) {
          *out = i;
          return Status::Ok();
        }
      }
      break;
    case OptionKind::kPath:
      return Status::Error(Code::kInvalidArgument, std::string("option '") + row.name + "' is a path, not a number");
  }
  return Status::Error(Code::kInvalidArgument,
                       std::string(row.name) + " must be " + option_takes(row.kind) + ", got '" + text + "'");
}

std::string format_option(const OptionRow& row, uint64_t value) {
  if (row.kind == OptionKind::kStray && value >= 0 && value < 3) return kStrayNames[value];
  return std::to_string(value);
}

bool saver_holds(const OptionRow& row) {
  return (row.scopes & kSaverScope) && row.kind != OptionKind::kPath && strcmp(row.fallback, "auto") != 0;
}

uint64_t option_default(Option id) {
  const OptionRow& row = option_row(id);
  uint64_t value = 0;
  if (row.kind != OptionKind::kPath && strcmp(row.fallback, "auto") != 0) parse_option(row, row.fallback, &value);
  return value;
}

OptionValues::OptionValues() {
  for (size_t i = 0; i < kOptionCount; ++i) {
    const OptionRow& row = kRows[i];
    uint64_t value = 0;
    if (saver_holds(row)) parse_option(row, row.fallback, &value);
    values_[i].store(value, std::memory_order_relaxed);
  }
}

}  // namespace tmsl
