// The disk tier's copies: each paused allocation whose content is in a file, by address,
// with the tier that wrote it (the directory may change while it is paused). One owner for
// the file: a resume that makes the allocation resident takes it out (and so removes it), a
// free takes it out, the saver's end lets every one go.
//
// Locking: its own; the saver may call it holding its table lock, never the reverse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace tmsl {

class DiskFile;  // disk_tier.h, which needs the tiers: only declared here
class DiskTier;

class DiskCopies {
 public:
  struct Copy {
    std::shared_ptr<DiskFile> file;  // removed once the last holder lets go
    std::shared_ptr<DiskTier> tier;  // what reads it back
    size_t bytes = 0;                // what the file holds
    explicit operator bool() const { return file != nullptr; }
  };

  void put(uintptr_t va, Copy copy) {
    std::lock_guard<std::mutex> lock(mu_);
    copies_[va] = std::move(copy);
  }
  // va's copy, left in place (empty where none).
  Copy find(uintptr_t va) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = copies_.find(va);
    return it == copies_.end() ? Copy{} : it->second;
  }
  bool has(uintptr_t va) const {
    std::lock_guard<std::mutex> lock(mu_);
    return copies_.count(va) != 0;
  }
  // The bytes va's file holds (0 where none).
  size_t bytes(uintptr_t va) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = copies_.find(va);
    return it == copies_.end() ? 0 : it->second.bytes;
  }
  // Takes va's copy out (empty where none): the caller's to let go.
  Copy take(uintptr_t va) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = copies_.find(va);
    if (it == copies_.end()) return Copy{};
    Copy copy = std::move(it->second);
    copies_.erase(it);
    return copy;
  }

 private:
  mutable std::mutex mu_;
  std::map<uintptr_t, Copy> copies_;
};

}  // namespace tmsl
