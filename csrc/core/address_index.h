// The base addresses a saver holds, answerable without the saver's table lock: under
// LD_PRELOAD every cudaFree in the process asks "is this ours?", so the question is
// spread over independent shards (no global lock) and skipped entirely while empty.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_set>

namespace tmsl {

class AddressIndex {
 public:
  void insert(uintptr_t va) {
    Shard& s = shard(va);
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.addresses.insert(va).second) count_.fetch_add(1, std::memory_order_relaxed);
  }

  void erase(uintptr_t va) {
    Shard& s = shard(va);
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.addresses.erase(va) != 0) count_.fetch_sub(1, std::memory_order_relaxed);
  }

  bool contains(uintptr_t va) const {
    if (count_.load(std::memory_order_relaxed) == 0) return false;
    const Shard& s = shard(va);
    std::lock_guard<std::mutex> lock(s.mu);
    return s.addresses.count(va) != 0;
  }

 private:
  static constexpr size_t kShards = 64;
  struct Shard {
    mutable std::mutex mu;
    std::unordered_set<uintptr_t> addresses;
  };
  // Bases are granularity-aligned (2 MiB on GPUs): hash above those bits.
  Shard& shard(uintptr_t va) { return shards_[(va >> 21) % kShards]; }
  const Shard& shard(uintptr_t va) const { return shards_[(va >> 21) % kShards]; }

  std::array<Shard, kShards> shards_;
  std::atomic<size_t> count_{0};
};

}  // namespace tmsl
