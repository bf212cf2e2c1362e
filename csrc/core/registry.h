// The process's savers, found by handle.
//
// The process-wide saver (CUDA backend) is what the allocation hooks serve; further savers
// (host backend) exist for tests. A handle names a slot and the generation of the saver in
// it, so the handle of a destroyed saver never reaches a saver made later in the same slot
// (it resolves to nothing). The process-wide saver is never destroyed, so frees that arrive
// during interpreter or process teardown still find it. Lookups from the hooks (owner_of,
// find_saver) read a fixed array of atomics: no lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "core/saver.h"

namespace tmsl {

using SaverHandle = uint64_t;  // 0: no saver

// A counted reference to a live saver; empty when the lookup found none.
class SaverRef {
 public:
  SaverRef() = default;
  SaverRef(Saver* saver, std::atomic<int>* users) : saver_(saver), users_(users) {}
  SaverRef(SaverRef&& other) noexcept : saver_(other.saver_), users_(other.users_) {
    other.saver_ = nullptr;
    other.users_ = nullptr;
  }
  SaverRef& operator=(SaverRef&& other) noexcept {
    std::swap(saver_, other.saver_);
    std::swap(users_, other.users_);
    return *this;
  }
  SaverRef(const SaverRef&) = delete;
  SaverRef& operator=(const SaverRef&) = delete;
  ~SaverRef() {
    if (users_ != nullptr) users_->fetch_sub(1);
  }
  explicit operator bool() const { return saver_ != nullptr; }
  Saver* operator->() const { return saver_; }
  Saver& operator*() const { return *saver_; }

 private:
  Saver* saver_ = nullptr;
  std::atomic<int>* users_ = nullptr;
};

// The node's host-memory budget a saver made here takes its backups from: the api layer
// picks it (the node's ledger) and hands it down; asked only when a saver is made.
using BudgetSource = HostBudget& (*)();
// Creates the CUDA-backed saver on first call; fails (and retries next time) without a driver.
Status default_saver(BudgetSource budget, SaverHandle* out);
// The process-wide saver's handle, or 0 if it was never created (creates nothing).
SaverHandle existing_default_saver();
Status add_saver(std::unique_ptr<Saver> saver, SaverHandle* out);
// Destroys a saver made by add_saver (the process-wide one cannot be removed): from now on
// its handle finds nothing; it is deleted once the calls still using it have returned.
Status remove_saver(SaverHandle handle);
// The live saver a handle names; empty when destroyed or never made.
SaverRef find_saver(SaverHandle handle);
// The saver holding an allocation that starts at va; empty when none does.
SaverRef owner_of(uintptr_t va);

}  // namespace tmsl
