// Content fingerprints: whether two chunks of backed-up memory hold the same bytes, decided
// where the bytes are (on the GPU, before any copy) from 32 bytes each. Identity is decided by
// the fingerprint alone: a keyed universal hash with a secret key the node's processes share
// (node_store.h keeps it in the user's private store). Not a cryptographic hash: its bound is
// for bytes chosen without knowing the key, whose secrecy is its strength (docs/guarantees.md
// derives the bound).
//
// The definition, which both halves compute bit for bit (the GPU half is
// fingerprint_kernel.cu, run by the CUDA backend; the CPU half is fingerprint.cpp, run by the
// host backend and by tests as the reference):
//   - The bytes, a multiple of 1 KiB, are blocks of 256 little-endian 32-bit words m[0..255].
//   - Each of 4 lanes j has a key of 256 words K[j] and a point r[j] in [1, p), p = 2^61 - 1.
//   - NH: each block gives, per lane, n = sum over i < 128 of
//     ((m[2i] + K[j][2i]) mod 2^32) * ((m[2i+1] + K[j][2i+1]) mod 2^32), mod 2^64.
//   - The lane's value is the polynomial over the NH sums' 32-bit halves (low first, block by
//     block): h = 0, then h = (h + e) * r[j] mod p for each half e.
// NH is 2^-32-almost-universal and the polynomial adds (halves - 1) * 9/2^64 (r's draw is at
// most 9/8 times uniform), so two different chunks of at most 64 MiB collide in one lane with
// probability below 2^-31.99 and in all four (keys drawn independently) below 2^-127: a match
// is trusted as identity.
//
// Devices compute a value per segment of 256 blocks (256 KiB); join_segments folds the
// segments of a chunk into its fingerprint (h over a segment of L halves is sum e_t r^(L - t),
// so a chunk's value is the segments' values joined by h = h * r^L + v).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "platform/status.h"

namespace tmsl {

constexpr size_t kFingerprintLanes = 4;
constexpr size_t kFingerprintBlockBytes = 1024;
constexpr size_t kFingerprintBlockWords = kFingerprintBlockBytes / 4;
constexpr size_t kFingerprintSegmentBlocks = 256;
constexpr size_t kFingerprintSegmentBytes = kFingerprintSegmentBlocks * kFingerprintBlockBytes;

struct FingerprintKey {
  uint32_t nh[kFingerprintLanes][kFingerprintBlockWords] = {};
  uint64_t poly[kFingerprintLanes] = {};

  // A key drawn from the kernel's random source (getrandom).
  static Status random(FingerprintKey* out);
  // A key derived from `seed` (tests: the same key in every process and on both halves).
  static FingerprintKey from_seed(uint64_t seed);
  // Whether it is a key (its points in [1, p)).
  bool valid() const;
};

struct Fingerprint {
  uint64_t lanes[kFingerprintLanes] = {};
  size_t bytes = 0;

  bool operator==(const Fingerprint& other) const;
  // "<64 hex digits>-<bytes>": a chunk's name in the node's store.
  std::string name() const;
};

// How many segment values `bytes` gives (the last segment may be short).
inline size_t fingerprint_segments_in(size_t bytes) {
  return (bytes + kFingerprintSegmentBytes - 1) / kFingerprintSegmentBytes;
}
// Whether bytes can be fingerprinted: a positive multiple of the block.
inline bool fingerprintable(size_t bytes) { return bytes > 0 && bytes % kFingerprintBlockBytes == 0; }

// The CPU half: the value of each segment of the `bytes` at `data` (fingerprintable), lane by
// lane: out[s * kFingerprintLanes + j], for fingerprint_segments_in(bytes) segments.
void fingerprint_segments(const char* data, size_t bytes, const FingerprintKey& key, uint64_t* out);
// The fingerprint of `bytes` whose segment values (from either half) are at `segments`.
Fingerprint join_segments(const uint64_t* segments, size_t bytes, const FingerprintKey& key);
// The fingerprint of host bytes (the CPU half, then join_segments).
Fingerprint fingerprint_bytes(const char* data, size_t bytes, const FingerprintKey& key);
// The fingerprint of `bytes` zeros (fingerprintable), without reading them all.
Fingerprint fingerprint_of_zeros(size_t bytes, const FingerprintKey& key);

// The GPU half's PTX text (fingerprint_kernel.ptx) and its entry point's name.
const char* fingerprint_kernel_ptx();
constexpr const char* kFingerprintKernelName = "tmsl_fingerprint_segments";

}  // namespace tmsl
