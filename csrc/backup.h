// Host memory that holds the content of a paused allocation until it is resumed.
#pragma once

#include <cstddef>
#include <memory>

#include "status.h"

namespace tmsl {

class HostBuffer {
 public:
  // Anonymous private memory, transparent huge pages asked for (fewer page faults and
  // TLB misses on multi-GiB backups). Fails with Code::kOutOfMemory when the host has
  // no room.
  static Status allocate(size_t size, std::unique_ptr<HostBuffer>* out);

  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  HostBuffer(void* data, size_t size) : data_(data), size_(size) {}
  void* data_;
  size_t size_;
};

}  // namespace tmsl
