// The wake check's record in each allocation's row (core/allocation.h), written only by
// WakeChecks (core/wake_checks.h): what the allocation's resume checks its restored bytes
// against, and the mark a resume checks one piece behind.
#pragma once

#include <cstddef>
#include <vector>

#include "platform/backend.h"
#include "platform/fingerprint.h"

namespace tmsl {

struct Allocation;

// Its record: what its resume checks the restored bytes against.
struct WakeRecord {
  // The fingerprints of its backed-up bytes, chunk by chunk (HostArena::kRangeBytes), when
  // its pause copied them, under `key`. Empty: not checked.
  std::vector<Fingerprint> fingerprints;
  const FingerprintKey* key = nullptr;
  bool unchecked = false;  // its pause copied it without fingerprints
  bool verify = true;  // whether its tag's wakes are checked, when a pause or resume claimed it (checked_for)
  size_t checked_chunks = 0;  // of fingerprints, those its resume checked so far
};

// A resume's check one piece behind its copies: once a's bytes [0, restored) are queued, the
// chunks the pieces queued before are checked (after their copies' mark) while the newest
// piece's copy runs, so a wake's check costs about one piece's fingerprint.
struct WakeCheckBehind {
  Allocation* a = nullptr;  // its bytes [0, restored) lie before `mark` on the copy stream
  size_t restored = 0;
  CopyMark mark = 0;
  bool marked = false;
};

}  // namespace tmsl
