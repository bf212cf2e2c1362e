#include "registry.h"

#include <array>
#include <atomic>
#include <mutex>

#include "thread_region.h"

namespace tmsl {
namespace {

constexpr size_t kMaxSavers = 64;
constexpr int kSlotBits = 8;  // a handle: generation << kSlotBits | (slot + 1)

struct Slot {
  std::atomic<Saver*> saver{nullptr};
  std::atomic<uint64_t> generation{0};
};

struct Registry {
  std::mutex mu;  // serializes changes; readers use the atomics
  std::array<Slot, kMaxSavers> slots{};
  std::atomic<SaverHandle> process_wide{0};
};

// Never destroyed: the allocation hooks may run during static destruction.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

// Puts a saver in a free slot, where owner_of and find_saver see it. Needs the lock.
Status publish(Registry& r, Saver* saver, SaverHandle* out) {
  for (size_t i = 0; i < kMaxSavers; ++i) {
    Slot& slot = r.slots[i];
    if (slot.saver.load() != nullptr) continue;
    uint64_t generation = slot.generation.load() + 1;
    slot.generation.store(generation, std::memory_order_release);
    slot.saver.store(saver, std::memory_order_release);
    *out = generation << kSlotBits | (i + 1);
    return Status::Ok();
  }
  return Status::Error(Code::kInvalidArgument,
                       "too many savers (at most 64 at once): close() the ones no longer needed");
}

}  // namespace

Status default_saver(SaverHandle* out) {
  Registry& r = registry();
  if (SaverHandle existing = r.process_wide.load(std::memory_order_acquire)) {
    *out = existing;
    return Status::Ok();
  }
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.process_wide.load() == 0) {
    std::unique_ptr<Backend> backend;
    Status s = make_cuda_backend(&backend);
    if (!s.ok()) return s;
    auto saver = std::make_unique<Saver>(std::move(backend));
    saver->set_poison_on_resume(process_defaults().poison_on_resume);
    // Unpublished, the hooks could not find its allocations to free them.
    SaverHandle handle = 0;
    s = publish(r, saver.get(), &handle);
    if (!s.ok()) return s;
    saver.release();
    r.process_wide.store(handle, std::memory_order_release);
  }
  *out = r.process_wide.load();
  return Status::Ok();
}

Status add_saver(std::unique_ptr<Saver> saver, SaverHandle* out) {
  saver->set_poison_on_resume(process_defaults().poison_on_resume);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  Status s = publish(r, saver.get(), out);
  if (s.ok()) saver.release();
  return s;
}

Status remove_saver(SaverHandle handle) {
  Registry& r = registry();
  Saver* saver = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (handle != 0 && handle == r.process_wide.load()) {
      return Status::Error(Code::kInvalidArgument, "the process-wide saver cannot be destroyed");
    }
    saver = find_saver(handle);
    if (saver == nullptr) return Status::Error(Code::kInvalidArgument, "invalid or destroyed saver handle");
    Slot& slot = r.slots[(handle & ((1u << kSlotBits) - 1)) - 1];
    slot.generation.store(slot.generation.load() + 1, std::memory_order_release);  // handles die first
    slot.saver.store(nullptr, std::memory_order_release);
  }
  delete saver;
  return Status::Ok();
}

Saver* find_saver(SaverHandle handle) {
  const uint64_t index = handle & ((1u << kSlotBits) - 1);
  if (index == 0 || index > kMaxSavers) return nullptr;
  const Slot& slot = registry().slots[index - 1];
  const uint64_t generation = handle >> kSlotBits;
  if (slot.generation.load(std::memory_order_acquire) != generation) return nullptr;
  Saver* saver = slot.saver.load(std::memory_order_acquire);
  return slot.generation.load(std::memory_order_acquire) == generation ? saver : nullptr;
}

Saver* owner_of(uintptr_t va) {
  for (const Slot& slot : registry().slots) {
    Saver* saver = slot.saver.load(std::memory_order_acquire);
    if (saver != nullptr && saver->owns(va)) return saver;
  }
  return nullptr;
}

}  // namespace tmsl
