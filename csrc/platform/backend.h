// The operations the saver core needs from the memory system, with two implementations:
// CUDA virtual memory management (backend_cuda.cpp) and a host one built on Linux
// primitives (backend_host.cpp) that behaves the same way, so the core runs under test
// on machines without a GPU.
//
// Life of an allocation: reserve a VA range, create physical memory, map it into the
// range, set access. Pause: copy out (optional), unmap, release physical. Resume: create,
// map, set access, copy in. The VA range is only given back by free_reservation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "platform/fingerprint.h"
#include "platform/status.h"

namespace tmsl {

using PhysicalHandle = uint64_t;
using CopyMark = uint64_t;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Whether allocations land on the CUDA runtime's current device; the host backend has
  // one device, 0, whatever the runtime (if any) says.
  virtual bool follows_current_device() const { return true; }

  // Size every reservation and physical allocation on `device` is a multiple of.
  virtual Status granularity(int device, size_t* out) = 0;

  // Largest piece a resume maps a large backed-up allocation in (see Pieces in mapping.h):
  // large enough that driver calls stay few, small enough that the first copy starts early.
  virtual size_t resume_piece_bytes(int device) const {
    (void)device;
    return size_t{256} << 20;
  }

  // The scratch that paused memory without a backup maps while paused (core/stray_catcher.h):
  // its size (rounded up to the granularity), and its making. Each mapping of it costs a map
  // and an access change (about 40 us on an H100/H200, whatever its size), so it is large
  // enough that an 8 GiB range takes few, and small beside a GPU's memory.
  virtual size_t stray_scratch_bytes(int device) const {
    (void)device;
    return size_t{128} << 20;
  }
  virtual Status create_scratch(int device, size_t size, PhysicalHandle* out) {
    return create_physical(device, size, out);
  }
  virtual Status release_scratch(int device, PhysicalHandle handle, size_t size) {
    return release_physical(device, handle, size);
  }

  // Host memory the GPU maps like its own (CUDA virtual memory, located on the host NUMA node
  // nearest `device`): a soft pause's host copy (tiers/soft_arena.cpp), mapped once for itself
  // with set_host_access (the host and the device may read and write it) and, while its
  // allocation is paused, at the allocation's own address with set_access. kUnsupported where
  // the driver cannot make it (the caller pauses as before). Not counted as device memory.
  virtual Status create_host_physical(int device, size_t size, PhysicalHandle* out) {
    (void)device, (void)size, (void)out;
    return Status::Error(Code::kUnsupported, "this backend has no host memory it can map at device addresses");
  }
  virtual Status release_host_physical(int device, PhysicalHandle handle, size_t size) {
    return release_physical(device, handle, size);
  }
  virtual Status set_host_access(int device, uintptr_t va, size_t size) { return set_access(device, va, size); }

  virtual Status reserve(int device, size_t size, size_t alignment, uintptr_t* va) = 0;
  virtual Status free_reservation(int device, uintptr_t va, size_t size) = 0;

  // Fails with Code::kOutOfMemory when the device has no room.
  virtual Status create_physical(int device, size_t size, PhysicalHandle* out) = 0;
  virtual Status release_physical(int device, PhysicalHandle handle, size_t size) = 0;

  virtual Status map(int device, uintptr_t va, size_t size, PhysicalHandle handle) = 0;
  virtual Status unmap(int device, uintptr_t va, size_t size) = 0;
  virtual Status set_access(int device, uintptr_t va, size_t size) = 0;

  // Page-locks host memory for DMA from every device (a no-op on the host backend);
  // `read_only`: memory mapped read-only (a shared backup), which DMA only reads.
  virtual Status register_host(int device, void* ptr, size_t size, bool read_only) = 0;
  virtual Status unregister_host(int device, void* ptr) = 0;

  // Copies between mapped memory and registered host memory, queued on the backend's own
  // copy stream for `device`; wait_copies returns when every queued copy has landed.
  virtual Status copy_to_host_async(int device, void* dst, uintptr_t src, size_t size) = 0;
  virtual Status copy_from_host_async(int device, uintptr_t dst, const void* src, size_t size) = 0;
  // Copies between two ranges the device maps (its memory, or host memory it maps like its
  // own: a soft pause's copy), queued like the copies above.
  virtual Status copy_async(int device, uintptr_t dst, uintptr_t src, size_t size) = 0;
  // Sets every byte of mapped memory to `value`, queued like the copies (poison on resume).
  virtual Status fill_async(int device, uintptr_t va, size_t size, unsigned char value) = 0;
  virtual Status wait_copies(int device) = 0;
  // A point on the device's copy stream after everything queued there so far (a CUDA
  // event): once wait_copy_mark returns for it, those copies have landed, while later ones
  // may still run. Each mark is waited for exactly once, which also frees it.
  virtual Status mark_copies(int device, CopyMark* out) = 0;
  virtual Status wait_copy_mark(int device, CopyMark mark) = 0;

  // Waits for all outstanding work on the device, or on one stream of it.
  virtual Status synchronize_device(int device) = 0;
  virtual Status synchronize_stream(int device, void* stream) = 0;

  virtual Status memory_info(int device, size_t* free_bytes, size_t* total_bytes) = 0;

  // The content fingerprint's segment values (platform/fingerprint.h) of the mapped memory
  // [va, va + bytes) (fingerprintable), computed where it lies, into host memory `out`
  // (fingerprint_segments_in(bytes) * kFingerprintLanes values); returns once `out` is written.
  // It runs beside the copies, after those before the mark `after` where given (the mark is
  // still the caller's to wait for). kUnsupported where the device cannot (a driver without
  // the entry points, no room for its small buffers): the caller does without.
  virtual Status fingerprint(int device, uintptr_t va, size_t bytes, const FingerprintKey& key, uint64_t* out,
                             const CopyMark* after = nullptr) = 0;
};

// Opens the CUDA driver (libcuda.so.1, or $TMSL_CUDA_DRIVER_LIBRARY) at run time.
// Fails with Code::kNoDriver where there is none.
Status make_cuda_backend(std::unique_ptr<Backend>* out);

// capacity_bytes == 0 means no limit beyond the machine's own.
std::unique_ptr<Backend> make_host_backend(size_t capacity_bytes, size_t granularity_bytes);
// Tests only: make the `after_calls`-th next call of `operation` (a method name above, e.g.
// "map") on a host backend, and the `times` - 1 calls after it, fail as a driver error would.
// Any other backend refuses (kInvalidArgument).
Status inject_host_fault(Backend& backend, const std::string& operation, long after_calls, long times);

}  // namespace tmsl
