// Host backend: the CUDA VMM life cycle on Linux primitives.
//   reserve          mmap(PROT_NONE) of anonymous memory
//   create_physical  memfd_create + ftruncate (pages come into being when first touched)
//   map              mmap(MAP_FIXED | MAP_SHARED) of the memfd over the reserved range,
//                    PROT_NONE until set_access, like cuMemMap before cuMemSetAccess
//   unmap            map PROT_NONE anonymous memory over the range again: the VA stays taken
//   release          close(fd): with no mapping left the kernel frees the pages
// So a pause really gives pages back, and a resume really gets fresh zero pages at the
// same address. An optional capacity makes create_physical fail like a full GPU.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <set>
#include <mutex>

#include "platform/backend.h"

namespace tmsl {
namespace {

// Injected failures: operation -> calls left until the first that fails, and how many fail.
class FaultPlan {
 public:
  static const std::set<std::string>& operations() {
    static const std::set<std::string> names = {
        "reserve", "free_reservation", "create_physical", "release_physical", "map", "unmap",
        "set_access", "create_host_physical", "register_host", "register_host_read_only", "copy_to_host_async",
        "copy_from_host_async", "copy_async", "wait_copies", "synchronize_device", "fingerprint"};
    return names;
  }

  Status arm(const std::string& operation, long after_calls, long times) {
    if (operations().count(operation) == 0 || after_calls < 1 || times < 1) {
      return Status::Error(Code::kInvalidArgument, "cannot inject a fault into '" + operation + "' after " +
                                                       std::to_string(after_calls) + " calls, " +
                                                       std::to_string(times) + " times");
    }
    std::lock_guard<std::mutex> lock(mu_);
    armed_[operation] = Armed{after_calls, times};
    return Status::Ok();
  }

  Status check(const char* operation) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = armed_.find(operation);
    if (it == armed_.end() || --it->second.countdown > 0) return Status::Ok();
    if (--it->second.times == 0) {
      armed_.erase(it);
    } else {
      it->second.countdown = 1;  // the next call fails too
    }
    return Status::Error(Code::kDriverError, std::string("injected fault in ") + operation);
  }

 private:
  struct Armed {
    long countdown;
    long times;
  };
  std::mutex mu_;
  std::map<std::string, Armed> armed_;
};

#define TMSL_FAULT_POINT(op)                 \
  do {                                       \
    Status injected = faults_.check(op);     \
    if (!injected.ok()) return injected;     \
  } while (0)

// Page-locked host ranges, kept as the driver keeps them. One CUDA copy may not cross from
// one registration into the next (cuMemcpy answers "invalid value"), so this backend
// refuses such a copy too: CI then catches a backup that spans two registrations.
class HostRegistrations {
 public:
  Status add(void* p, size_t size) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto next = ranges_.lower_bound(start);
    bool overlaps = (next != ranges_.end() && next->first < start + size) ||
                    (next != ranges_.begin() && std::prev(next)->second > start);
    if (overlaps) {
      return Status::Error(Code::kInvalidArgument, format_bytes(size) + " at " + format_address(start) +
                                                       " overlaps memory already page-locked");
    }
    ranges_[start] = start + size;
    return Status::Ok();
  }

  void remove(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.erase(reinterpret_cast<uintptr_t>(p));
  }

  Status check_copy(const void* host, size_t size) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(host);
    std::lock_guard<std::mutex> lock(mu_);
    auto after = ranges_.upper_bound(start);
    if (after == ranges_.begin() || std::prev(after)->second < start + size) {
      return Status::Error(Code::kInvalidArgument,
                           "copy of " + format_bytes(size) + " at host address " + format_address(start) +
                               " does not lie inside one page-locked range (CUDA refuses it the same way)");
    }
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, uintptr_t> ranges_;  // start -> end
};

class HostBackend final : public Backend {
 public:
  HostBackend(size_t capacity, size_t granularity)
      : capacity_(capacity), granularity_(granularity) {}

  const char* name() const override { return "host"; }
  bool follows_current_device() const override { return false; }

  Status granularity(int device, size_t* out) override {
    if (device < 0) return Status::Error(Code::kInvalidArgument, "device must be >= 0");
    *out = granularity_;
    return Status::Ok();
  }

  // A few granules: so the tests' allocations of a few MiB already resume in pieces.
  size_t resume_piece_bytes(int) const override { return 4 * granularity_; }

  Status reserve(int, size_t size, size_t alignment, uintptr_t* va) override {
    TMSL_FAULT_POINT("reserve");
    // Over-reserve so the start can be aligned, then trim both ends.
    size_t span = size + alignment;
    void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return errno_status("mmap(reserve " + format_bytes(size) + ")", errno);
    uintptr_t start = reinterpret_cast<uintptr_t>(p);
    uintptr_t aligned = (start + alignment - 1) / alignment * alignment;
    if (aligned > start) munmap(p, aligned - start);
    uintptr_t end = start + span, aligned_end = aligned + size;
    if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
    *va = aligned;
    return Status::Ok();
  }

  Status free_reservation(int, uintptr_t va, size_t size) override {
    TMSL_FAULT_POINT("free_reservation");
    if (munmap(reinterpret_cast<void*>(va), size) != 0) return errno_status("munmap", errno);
    return Status::Ok();
  }

  Status create_physical(int device, size_t size, PhysicalHandle* out) override {
    TMSL_FAULT_POINT("create_physical");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (capacity_ != 0 && used_ + size > capacity_) {
        Status s = Status::Error(
            Code::kOutOfMemory, "host backend capacity of " + format_bytes(capacity_) + " reached on device " +
                                    std::to_string(device) + ": " + format_bytes(size) + " requested");
        return s;
      }
      used_ += size;
    }
    Status s = create_memfd("tmsl", size, out);
    if (!s.ok()) give_back(size);
    return s;
  }

  // Two granules, so that tests' ranges of a few MiB already take several mappings. Its
  // memory is the saver's own, not the users': outside the capacity, which models theirs.
  size_t stray_scratch_bytes(int) const override { return 2 * granularity_; }
  Status create_scratch(int, size_t size, PhysicalHandle* out) override {
    TMSL_FAULT_POINT("create_physical");
    return create_memfd("tmsl-scratch", size, out);
  }
  Status release_scratch(int, PhysicalHandle handle, size_t) override {
    TMSL_FAULT_POINT("release_physical");
    if (close(static_cast<int>(handle)) != 0) return errno_status("close(memfd)", errno);
    return Status::Ok();
  }

  // Host memory is what every mapping here is made of; a soft pause's copies, like the
  // scratch, are not the users' device memory: outside the capacity.
  Status create_host_physical(int, size_t size, PhysicalHandle* out) override {
    TMSL_FAULT_POINT("create_host_physical");
    return create_memfd("tmsl-soft", size, out);
  }
  Status release_host_physical(int device, PhysicalHandle handle, size_t size) override {
    return release_scratch(device, handle, size);
  }

  Status release_physical(int, PhysicalHandle handle, size_t size) override {
    TMSL_FAULT_POINT("release_physical");
    int rc = close(static_cast<int>(handle));
    give_back(size);
    if (rc != 0) return errno_status("close(memfd)", errno);
    return Status::Ok();
  }

  Status map(int, uintptr_t va, size_t size, PhysicalHandle handle) override {
    TMSL_FAULT_POINT("map");
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle), 0);
    if (p == MAP_FAILED) return errno_status("mmap(map memfd)", errno);
    // Like device memory, a mapping is not inherited by a forked child: a shared mapping
    // would let the child's writes reach this process.
    madvise(p, size, MADV_DONTFORK);
    return Status::Ok();
  }

  Status unmap(int, uintptr_t va, size_t size) override {
    TMSL_FAULT_POINT("unmap");
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return errno_status("mmap(unmap)", errno);
    return Status::Ok();
  }

  Status set_access(int, uintptr_t va, size_t size) override {
    TMSL_FAULT_POINT("set_access");
    if (mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE) != 0)
      return errno_status("mprotect", errno);
    return Status::Ok();
  }

  Status register_host(int, void* p, size_t size, bool read_only) override {
    TMSL_FAULT_POINT("register_host");
    if (read_only) TMSL_FAULT_POINT("register_host_read_only");  // a driver without it
    return registrations_.add(p, size);
  }
  Status unregister_host(int, void* p) override {
    registrations_.remove(p);
    return Status::Ok();
  }

  // Host memory has no copy engine: the copies happen at once.
  Status copy_to_host_async(int, void* dst, uintptr_t src, size_t size) override {
    TMSL_FAULT_POINT("copy_to_host_async");
    Status s = registrations_.check_copy(dst, size);
    if (s.ok()) memcpy(dst, reinterpret_cast<const void*>(src), size);
    return s;
  }

  Status copy_from_host_async(int, uintptr_t dst, const void* src, size_t size) override {
    TMSL_FAULT_POINT("copy_from_host_async");
    Status s = registrations_.check_copy(src, size);
    if (s.ok()) memcpy(reinterpret_cast<void*>(dst), src, size);
    return s;
  }

  Status copy_async(int, uintptr_t dst, uintptr_t src, size_t size) override {
    TMSL_FAULT_POINT("copy_async");
    memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size);
    return Status::Ok();
  }

  Status fill_async(int, uintptr_t va, size_t size, unsigned char value) override {
    memset(reinterpret_cast<void*>(va), value, size);
    return Status::Ok();
  }

  // The CPU half, over the mapped pages themselves.
  // (Copies here have landed when queued: no mark to wait for.)
  Status fingerprint(int, uintptr_t va, size_t bytes, const FingerprintKey& key, uint64_t* out,
                     const CopyMark*) override {
    TMSL_FAULT_POINT("fingerprint");
    fingerprint_segments(reinterpret_cast<const char*>(va), bytes, key, out);
    return Status::Ok();
  }

  Status wait_copies(int) override {
    TMSL_FAULT_POINT("wait_copies");
    return Status::Ok();
  }
  Status mark_copies(int, CopyMark* out) override {
    *out = 0;
    return Status::Ok();
  }
  // Fails where wait_copies would: both wait for queued copies.
  Status wait_copy_mark(int, CopyMark) override {
    TMSL_FAULT_POINT("wait_copies");
    return Status::Ok();
  }

  Status synchronize_device(int) override {
    TMSL_FAULT_POINT("synchronize_device");
    return Status::Ok();
  }
  Status synchronize_stream(int, void*) override { return Status::Ok(); }

  Status inject_fault(const std::string& operation, long after_calls, long times) {
    return faults_.arm(operation, after_calls, times);
  }

  Status memory_info(int, size_t* free_bytes, size_t* total_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ == 0) {
      long pages = sysconf(_SC_AVPHYS_PAGES), total = sysconf(_SC_PHYS_PAGES);
      long page = sysconf(_SC_PAGESIZE);
      *free_bytes = static_cast<size_t>(pages) * static_cast<size_t>(page);
      *total_bytes = static_cast<size_t>(total) * static_cast<size_t>(page);
    } else {
      *free_bytes = capacity_ - used_;
      *total_bytes = capacity_;
    }
    return Status::Ok();
  }

 private:
  static Status create_memfd(const char* name, size_t size, PhysicalHandle* out) {
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
      Status s = errno_status("memfd_create/ftruncate " + format_bytes(size), errno);
      if (fd >= 0) close(fd);
      return s;
    }
    *out = static_cast<PhysicalHandle>(fd);
    return Status::Ok();
  }

  void give_back(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    used_ -= size;
  }

  const size_t capacity_;
  const size_t granularity_;
  FaultPlan faults_;
  std::mutex mu_;
  size_t used_ = 0;
  HostRegistrations registrations_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(size_t capacity_bytes, size_t granularity_bytes) {
  return std::make_unique<HostBackend>(capacity_bytes, granularity_bytes);
}

Status inject_host_fault(Backend& backend, const std::string& operation, long after_calls, long times) {
  auto* host = dynamic_cast<HostBackend*>(&backend);
  if (host == nullptr) {
    return Status::Error(Code::kInvalidArgument, std::string("the ") + backend.name() +
                                                     " backend has no fault injection (host savers only)");
  }
  return host->inject_fault(operation, after_calls, times);
}

}  // namespace tmsl
