#include "platform/tag_rules.h"

#include <cstring>
#include <string>

namespace tmsl {
namespace {

// The number of characters in valid UTF-8 (no overlong forms, no surrogates, at most
// U+10FFFF), or -1 where the bytes are not UTF-8.
long utf8_characters(const unsigned char* s, size_t n) {
  long characters = 0;
  for (size_t i = 0; i < n; ++characters) {
    const unsigned char c = s[i];
    size_t extra = 0;        // continuation bytes that follow
    unsigned long code = c;  // the code point
    unsigned long least = 0; // the smallest code point this length may carry (no overlong forms)
    if (c >= 0x80) {
      if ((c & 0xE0) == 0xC0) {
        extra = 1, code = c & 0x1F, least = 0x80;
      } else if ((c & 0xF0) == 0xE0) {
        extra = 2, code = c & 0x0F, least = 0x800;
      } else if ((c & 0xF8) == 0xF0) {
        extra = 3, code = c & 0x07, least = 0x10000;
      } else {
        return -1;
      }
    }
    if (i + extra >= n && extra > 0) return -1;
    for (size_t k = 1; k <= extra; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return -1;
      code = (code << 6) | (s[i + k] & 0x3F);
    }
    if (code < least || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return -1;
    i += extra + 1;
  }
  return characters;
}

}  // namespace

Status check_tag(const char* tag, size_t length) {
  if (tag == nullptr) return Status::Error(Code::kInvalidArgument, "tag must not be NULL");
  const std::string rule = "tag must be 1 to " + std::to_string(kMaxTagCharacters) +
                           " characters of UTF-8 without NUL";
  if (length == 0) return Status::Error(Code::kInvalidArgument, rule + ", got an empty tag");
  if (memchr(tag, '\0', length) != nullptr) {
    return Status::Error(Code::kInvalidArgument, rule + ", got one with a NUL character");
  }
  const long characters = length > kMaxTagBytes ? -2 : utf8_characters(reinterpret_cast<const unsigned char*>(tag), length);
  if (characters == -1) return Status::Error(Code::kInvalidArgument, rule + ", got bytes that are not UTF-8");
  if (characters == -2 || characters > static_cast<long>(kMaxTagCharacters)) {
    return Status::Error(Code::kInvalidArgument, rule + ", got one of " +
                                                     (characters == -2 ? std::to_string(length) + " bytes"
                                                                       : std::to_string(characters) + " characters"));
  }
  return Status::Ok();
}

Status check_tag(const char* tag) {
  if (tag == nullptr) return Status::Error(Code::kInvalidArgument, "tag must not be NULL");
  return check_tag(tag, strlen(tag));
}

}  // namespace tmsl
