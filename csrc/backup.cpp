#include "backup.h"

#include <sys/mman.h>

#include <cerrno>

namespace tmsl {

Status HostBuffer::allocate(size_t size, std::unique_ptr<HostBuffer>* out) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return errno_status("cannot allocate a host backup of " + format_bytes(size), errno);
  }
  madvise(p, size, MADV_HUGEPAGE);  // advisory: a kernel without THP still works
  out->reset(new HostBuffer(p, size));
  return Status::Ok();
}

HostBuffer::~HostBuffer() { munmap(data_, size_); }

}  // namespace tmsl
