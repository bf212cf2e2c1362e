// The one rule for tag names: the saver's tag catalogue applies it to every tag an allocation
// names, and the C ABI's regions, pauses, resumes and options check theirs with it before use
// (the Python side asks it through tmsl_check_tag instead of keeping a copy).
#pragma once

#include <cstddef>

#include "platform/status.h"

namespace tmsl {

constexpr size_t kMaxTagCharacters = 256;
constexpr size_t kMaxTagBytes = 4 * kMaxTagCharacters;  // what 256 characters of UTF-8 can take

// Ok when [tag, tag + length) is 1 to 256 characters of valid UTF-8 without NUL; else
// kInvalidArgument saying which part of the rule it breaks.
Status check_tag(const char* tag, size_t length);
// The same for a NUL-terminated tag (NULL refused).
Status check_tag(const char* tag);

}  // namespace tmsl
