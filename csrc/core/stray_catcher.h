// Stray access to paused memory without a backup (a KV cache), made harmless and seen. While
// such an allocation is paused, its address range maps a few pieces of device memory of the
// device, the scratch, again and again. A kernel that still reads or writes the range (a
// data-parallel dummy batch, a CUDA graph replayed by mistake) then touches the scratch instead
// of an unmapped address, which would end the CUDA context. The scratch is filled with one
// byte; a write into it changes its fingerprint, which check() compares with the fill's.
//
// The driver maps a handle only whole (a part of one is "not supported"), so the scratch is a
// ladder of rungs: the largest (Backend::stray_scratch_bytes) and each half of it down to the
// granularity. A range is covered by the largest as often as it fits, then by at most one of
// each smaller rung (its remainder's binary digits). A rung is made when an allocation first
// needs it (so a pause takes device memory only where that failed): at most twice the
// largest per device, less the granularity.
//
// Costs: the rungs' bytes, a map and an access change per rung mapped (about 25-35 us each on
// an H100/H200), one unmap per range at resume, and a fingerprint of the rungs where a pause or
// resume changes what is covered on a device (and a free of covered memory).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "core/mapping.h"
#include "platform/backend.h"
#include "platform/fingerprint.h"
#include "platform/status.h"

namespace tmsl {

class StrayCatcher {
 public:
  // `fill`: every byte of a scratch, what a stray read sees (the saver's poison byte).
  StrayCatcher(Backend& backend, Mappings& mappings, unsigned char fill)
      : backend_(backend), mappings_(mappings), fill_(fill) {}
  // Gives the scratches back; the saver has uncovered every range before.
  ~StrayCatcher();
  StrayCatcher(const StrayCatcher&) = delete;
  StrayCatcher& operator=(const StrayCatcher&) = delete;

  // Makes the rungs covering `size` bytes (a multiple of the granularity) needs on the device,
  // where missing: memory only, no stream work (it may run during a user's graph capture). A
  // failure leaves those missing, to be tried again next time.
  Status prepare(int device, size_t size);
  // prepare, then fills the device's rungs not filled yet (waits for the device's copy stream:
  // call it before queueing copies).
  Status ready_to_cover(int device, size_t size);
  // Maps the rungs over [va, va + size) (nothing mapped there; ready_to_cover first) and makes
  // the range accessible. On failure nothing stays mapped (what cannot be unmapped is
  // the orphans').
  Status cover(int device, uintptr_t va, size_t size);
  // Unmaps the scratch from a covered [va, va + size); on failure the range is the orphans'
  // (retried; nothing may be mapped there meanwhile).
  Status uncover(int device, uintptr_t va, size_t size);
  // Whether anything wrote into the device's rungs since they were filled (a fingerprint under
  // `key` differs from the fill's); refills those where something did. kUnsupported where
  // the device cannot fingerprint. Call it before queueing copies, like ready_to_cover.
  Status check(int device, const FingerprintKey& key, bool* written);
  // The device memory the device's rungs hold.
  size_t bytes(int device);

 private:
  struct Rung {
    PhysicalHandle handle = 0;
    uintptr_t va = 0;  // its own mapping: where it is filled and fingerprinted
    size_t size = 0;
    bool filled = false;
    const FingerprintKey* key = nullptr;  // `expected` is under it
    Fingerprint expected;
  };
  struct Ladder {
    size_t granularity = 0, largest = 0;  // its rungs' sizes: largest, largest / 2, ... granularity
    std::map<size_t, Rung> rungs;         // those made, by size
  };
  // The rung sizes covering `size` takes, largest first, each once (the largest: as often as
  // it fits, listed once).
  static std::vector<size_t> rungs_for(const Ladder& ladder, size_t size);
  // The device's ladder (made, without rungs, at first use); entries live until the end.
  Status ladder(int device, Ladder** out);
  Status make_rung(int device, size_t size, Rung* out);
  Status fill(int device, Rung* rung);

  Backend& backend_;
  Mappings& mappings_;
  const unsigned char fill_;
  std::mutex mu_;  // guards the ladders' shape; a rung, once made, lives until the end
  std::map<int, Ladder> ladders_;
};

}  // namespace tmsl
