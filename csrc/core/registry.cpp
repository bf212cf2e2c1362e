#include "core/registry.h"

#include <array>
#include <atomic>
#include <mutex>
#include <thread>

namespace tmsl {
namespace {

constexpr size_t kMaxSavers = 64;
constexpr int kSlotBits = 8;  // a handle: generation << kSlotBits | (slot + 1)

struct Slot {
  std::atomic<Saver*> saver{nullptr};
  std::atomic<uint64_t> generation{0};
  std::atomic<int> users{0};  // SaverRefs alive on this slot
  bool retiring = false;      // its saver is being deleted: not reused yet (under the lock)
  // The process-wide saver's slot: never emptied, so its references need no counting and
  // the hooked cudaFree of every foreign pointer stays a few plain loads.
  std::atomic<bool> permanent{false};
};

// A reference to the slot's saver if it is still `generation` (0: any); counted unless
// the slot is permanent.
SaverRef take(Slot& slot, uint64_t generation) {
  if (slot.permanent.load(std::memory_order_acquire)) {
    Saver* saver = slot.saver.load(std::memory_order_acquire);
    return generation == 0 || slot.generation.load() == generation ? SaverRef(saver, nullptr) : SaverRef();
  }
  slot.users.fetch_add(1);
  Saver* saver = slot.saver.load();
  if (saver != nullptr && (generation == 0 || slot.generation.load() == generation)) {
    return SaverRef(saver, &slot.users);
  }
  slot.users.fetch_sub(1);
  return SaverRef();
}

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
Status publish(Registry& r, Saver* saver, SaverHandle* out, bool permanent = false) {
  note_saver_made();
  for (size_t i = 0; i < kMaxSavers; ++i) {
    Slot& slot = r.slots[i];
    if (slot.saver.load() != nullptr || slot.retiring) continue;
    uint64_t generation = slot.generation.load() + 1;
    slot.generation.store(generation, std::memory_order_release);
    slot.permanent.store(permanent, std::memory_order_release);
    slot.saver.store(saver, std::memory_order_release);
    *out = generation << kSlotBits | (i + 1);
    return Status::Ok();
  }
  return Status::Error(Code::kInvalidArgument,
                       "too many savers (at most 64 at once): close() the ones no longer needed");
}

// The environment's defaults a new saver starts with (the options it holds, options.h, and
// TMSL_DISK_BACKUP_DIR), as the api layer read them: the library owns them, so a saver the
// hooks made has them too (tms_pause pauses disk-backed tags). A directory that cannot serve
// leaves the saver without one: its disk-backed pauses are refused, and the Python side,
// setting it again, says why.
void take_defaults(Saver* saver, const ProcessDefaults& d) {
  for (size_t i = 0; i < kOptionCount; ++i) {
    if (saver_holds(option_row(static_cast<Option>(i)))) saver->set_option(static_cast<Option>(i), d.saver_options[i]);
  }
  if (!d.disk_backup_dir.empty()) saver->set_disk_directory(d.disk_backup_dir);
}

}  // namespace

Status default_saver(SetupSource setup, const ProcessDefaults& defaults, SaverHandle* out) {
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
    auto saver = std::make_unique<Saver>(std::move(backend), setup());
    take_defaults(saver.get(), defaults);
    // Unpublished, the hooks could not find its allocations to free them.
    SaverHandle handle = 0;
    s = publish(r, saver.get(), &handle, /*permanent=*/true);
    if (!s.ok()) return s;
    saver.release();
    r.process_wide.store(handle, std::memory_order_release);
  }
  *out = r.process_wide.load();
  return Status::Ok();
}

SaverHandle existing_default_saver() { return registry().process_wide.load(std::memory_order_acquire); }

Status add_saver(std::unique_ptr<Saver> saver, const ProcessDefaults& defaults, SaverHandle* out) {
  take_defaults(saver.get(), defaults);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  Status s = publish(r, saver.get(), out);
  if (s.ok()) saver.release();
  return s;
}

Status remove_saver(SaverHandle handle) {
  Registry& r = registry();
  Saver* saver = nullptr;
  Slot* slot = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (handle != 0 && handle == r.process_wide.load()) {
      return Status::Error(Code::kInvalidArgument, "the process-wide saver cannot be destroyed");
    }
    {
      SaverRef ref = find_saver(handle);
      if (!ref) return Status::Error(Code::kInvalidArgument, "invalid or destroyed saver handle");
      saver = &*ref;
    }
    slot = &r.slots[(handle & ((1u << kSlotBits) - 1)) - 1];
    slot->generation.store(slot->generation.load() + 1);  // its handle finds nothing from now on
    slot->saver.store(nullptr);
    slot->retiring = true;
  }
  // Calls that found it before are still running (a pause, a free): they finish first.
  while (slot->users.load() != 0) std::this_thread::yield();
  delete saver;
  std::lock_guard<std::mutex> lock(r.mu);
  slot->retiring = false;
  return Status::Ok();
}

SaverRef find_saver(SaverHandle handle) {
  const uint64_t index = handle & ((1u << kSlotBits) - 1);
  const uint64_t generation = handle >> kSlotBits;
  if (index == 0 || index > kMaxSavers || generation == 0) return SaverRef();
  return take(registry().slots[index - 1], generation);
}

SaverRef owner_of(uintptr_t va) {
  // A forked child must not touch the parent's savers (a lock may have been held at the
  // fork): its frees go to the runtime, which knows no such pointer.
  if (in_forked_child()) return SaverRef();
  for (Slot& slot : registry().slots) {
    if (slot.saver.load(std::memory_order_relaxed) == nullptr) continue;  // the common case: cheap
    SaverRef ref = take(slot, 0);
    if (ref && ref->owns(va)) return ref;
  }
  return SaverRef();
}

}  // namespace tmsl
