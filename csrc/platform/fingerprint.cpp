// The CPU half of the content fingerprint (fingerprint.h has the definition): plain loops,
// lane by lane, in the definition's order, so that it is the reference the GPU half is tested
// against rather than a copy of its structure.
#include "platform/fingerprint.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace tmsl {
namespace {

constexpr uint64_t kPrime = (uint64_t{1} << 61) - 1;

uint64_t mod_p(unsigned __int128 x) {
  // 2^61 = 1 (mod p): fold the high bits onto the low ones until below p.
  while (x >> 61) x = (x & kPrime) + (x >> 61);
  const uint64_t v = static_cast<uint64_t>(x);
  return v == kPrime ? 0 : v;
}

uint64_t mul_mod(uint64_t a, uint64_t b) { return mod_p(static_cast<unsigned __int128>(a) * b); }

uint64_t pow_mod(uint64_t r, size_t e) {
  uint64_t result = 1;
  for (; e != 0; e >>= 1) {
    if (e & 1) result = mul_mod(result, r);
    r = mul_mod(r, r);
  }
  return result;
}

uint32_t word_at(const char* data, size_t i) {
  uint32_t w;
  memcpy(&w, data + 4 * i, 4);  // little-endian, as the GPU reads it
  return w;
}

uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// A point in [1, p) from 64 random bits (the bias is below 2^-60).
uint64_t point_from(uint64_t bits) { return bits % (kPrime - 1) + 1; }

}  // namespace

Status FingerprintKey::random(FingerprintKey* out) {
  FingerprintKey key;
  uint64_t points[kFingerprintLanes];
  for (auto [buffer, size] : {std::pair<void*, size_t>{key.nh, sizeof(key.nh)}, {points, sizeof(points)}}) {
    for (size_t done = 0; done < size;) {
      const ssize_t n = getrandom(static_cast<char*>(buffer) + done, size - done, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return errno_status("drawing a fingerprint key", n < 0 ? errno : EIO);
      done += static_cast<size_t>(n);
    }
  }
  for (size_t j = 0; j < kFingerprintLanes; ++j) key.poly[j] = point_from(points[j]);
  *out = key;
  return Status::Ok();
}

FingerprintKey FingerprintKey::from_seed(uint64_t seed) {
  FingerprintKey key;
  uint64_t state = seed;
  for (auto& lane : key.nh) {
    for (uint32_t& word : lane) word = static_cast<uint32_t>(splitmix64(&state) >> 32);
  }
  for (uint64_t& point : key.poly) point = point_from(splitmix64(&state));
  return key;
}

bool FingerprintKey::valid() const {
  for (uint64_t point : poly) {
    if (point == 0 || point >= kPrime) return false;
  }
  return true;
}

bool Fingerprint::operator==(const Fingerprint& other) const {
  return bytes == other.bytes && memcmp(lanes, other.lanes, sizeof(lanes)) == 0;
}

std::string Fingerprint::name() const {
  char text[kFingerprintLanes * 16 + 24];
  int at = 0;
  for (uint64_t lane : lanes) at += snprintf(text + at, sizeof(text) - at, "%016llx", static_cast<unsigned long long>(lane));
  snprintf(text + at, sizeof(text) - at, "-%zu", bytes);
  return text;
}

void fingerprint_segments(const char* data, size_t bytes, const FingerprintKey& key, uint64_t* out) {
  const size_t blocks = bytes / kFingerprintBlockBytes;
  for (size_t first = 0, s = 0; first < blocks; first += kFingerprintSegmentBlocks, ++s) {
    const size_t end = std::min(blocks, first + kFingerprintSegmentBlocks);
    for (size_t j = 0; j < kFingerprintLanes; ++j) {
      uint64_t h = 0;
      for (size_t b = first; b < end; ++b) {
        const char* block = data + b * kFingerprintBlockBytes;
        uint64_t nh = 0;
        for (size_t i = 0; i < kFingerprintBlockWords; i += 2) {
          const uint32_t x = word_at(block, i) + key.nh[j][i];
          const uint32_t y = word_at(block, i + 1) + key.nh[j][i + 1];
          nh += static_cast<uint64_t>(x) * y;
        }
        h = mul_mod(mod_p(h + (nh & 0xFFFFFFFFu)), key.poly[j]);
        h = mul_mod(mod_p(h + (nh >> 32)), key.poly[j]);
      }
      out[s * kFingerprintLanes + j] = h;
    }
  }
}

Fingerprint join_segments(const uint64_t* segments, size_t bytes, const FingerprintKey& key) {
  Fingerprint f;
  f.bytes = bytes;
  const size_t count = fingerprint_segments_in(bytes);
  for (size_t j = 0; j < kFingerprintLanes; ++j) {
    const uint64_t full = pow_mod(key.poly[j], 2 * kFingerprintSegmentBlocks);
    uint64_t h = 0;
    for (size_t s = 0; s < count; ++s) {
      const size_t blocks = std::min(kFingerprintSegmentBlocks, bytes / kFingerprintBlockBytes - s * kFingerprintSegmentBlocks);
      const uint64_t shift = blocks == kFingerprintSegmentBlocks ? full : pow_mod(key.poly[j], 2 * blocks);
      h = mod_p(static_cast<unsigned __int128>(mul_mod(h, shift)) + segments[s * kFingerprintLanes + j]);
    }
    f.lanes[j] = h;
  }
  return f;
}

Fingerprint fingerprint_bytes(const char* data, size_t bytes, const FingerprintKey& key) {
  std::vector<uint64_t> segments(fingerprint_segments_in(bytes) * kFingerprintLanes);
  fingerprint_segments(data, bytes, key, segments.data());
  return join_segments(segments.data(), bytes, key);
}

const char* fingerprint_kernel_ptx() {
  static const char text[] =
#include "fingerprint_kernel_ptx.inc"
      ;
  return text;
}

Fingerprint fingerprint_of_zeros(size_t bytes, const FingerprintKey& key) {
  // Every whole segment of zeros has the same values: one segment's, repeated.
  const std::vector<char> zeros(kFingerprintSegmentBytes, 0);
  const size_t whole = bytes / kFingerprintSegmentBytes, rest = bytes % kFingerprintSegmentBytes;
  std::vector<uint64_t> values(fingerprint_segments_in(bytes) * kFingerprintLanes);
  uint64_t segment[kFingerprintLanes];
  fingerprint_segments(zeros.data(), kFingerprintSegmentBytes, key, segment);
  for (size_t k = 0; k < whole; ++k) std::copy(segment, segment + kFingerprintLanes, &values[k * kFingerprintLanes]);
  if (rest != 0) fingerprint_segments(zeros.data(), rest, key, &values[whole * kFingerprintLanes]);
  return join_segments(values.data(), bytes, key);
}

}  // namespace tmsl
