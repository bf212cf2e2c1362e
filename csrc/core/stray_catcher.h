// Stray access to paused memory without a backup (a KV cache), made harmless and seen. While
// such an allocation is paused, its address range maps one piece of device memory per device,
// the scratch, again and again. A kernel that still reads or writes the range (a data-parallel
// dummy batch, a CUDA graph replayed by mistake) then touches the scratch instead of an
// unmapped address, which would end the CUDA context. The scratch is filled with one byte;
// a write into it changes its fingerprint, which check() compares with the fill's.
//
// Costs: the scratch's bytes per device (Backend::stray_scratch_bytes, made at the first
// allocation that may need it, so a pause never takes device memory), a map and an access
// change per scratch-sized step of a paused range, one unmap per range at resume, and a
// fingerprint of the scratch where a pause or resume changes what is covered on a device.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

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

  // Whether the device has its scratch (lock-free: asked at allocations).
  bool ready(int device) const;
  // Makes the device's scratch, once: memory only, no stream work (it may run during a
  // user's graph capture). A failure leaves none, to be tried again next time.
  Status prepare(int device);
  // Makes the scratch where missing and fills it where not filled yet (waits for the
  // device's copy stream: call it before queueing copies).
  Status ready_to_cover(int device);
  // Maps the scratch over [va, va + size) (nothing mapped there), in scratch-sized steps, and
  // makes the range accessible. On failure nothing stays mapped (what cannot be unmapped is
  // the orphans').
  Status cover(int device, uintptr_t va, size_t size);
  // Unmaps the scratch from a covered [va, va + size); on failure the range is the orphans'
  // (retried; nothing may be mapped there meanwhile).
  Status uncover(int device, uintptr_t va, size_t size);
  // Whether anything wrote into the device's scratch since it was filled (its fingerprint
  // under `key` differs from the fill's); refills it where something did. kUnsupported where
  // the device cannot fingerprint. Call it before queueing copies, like ready_to_cover.
  Status check(int device, const FingerprintKey& key, bool* written);

 private:
  struct Scratch {
    PhysicalHandle handle = 0;
    uintptr_t va = 0;  // its own mapping: where it is filled and fingerprinted
    size_t size = 0;
    bool filled = false;
    const FingerprintKey* key = nullptr;  // `expected` is under it
    Fingerprint expected;
  };
  Scratch* find(int device);
  Status fill(int device, Scratch* scratch);

  Backend& backend_;
  Mappings& mappings_;
  const unsigned char fill_;
  mutable std::mutex mu_;  // guards scratches_'s shape; an entry, once made, lives until the end
  std::map<int, Scratch> scratches_;
  std::atomic<uint64_t> ready_low_{0};  // devices 0..63 that have one (others: asked under mu_)
};

}  // namespace tmsl
