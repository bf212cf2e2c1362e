// The process's savers, found by handle.
//
// The process-wide saver (CUDA backend) is what the allocation hooks serve; further savers
// (host backend) exist for tests. A handle names a slot and the generation of the saver in
// it, so the handle of a destroyed saver never reaches a saver made later in the same slot
// (it resolves to nothing). A saver is made with what the api layer hands (SetupSource, the
// process defaults). The process-wide saver is never destroyed, so frees that arrive
// during interpreter or process teardown still find it. Lookups from the hooks (owner_of,
// find_saver) read a fixed array of atomics: no lock.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "core/saver.h"
#include "platform/environment.h"

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

// What a saver made here is handed (SaverSetup: the node's budget and store): the api layer
// makes it (api/node_budget.h) and hands it down; asked only when a saver is made, so the
// node's ledger opens with the first saver.
using SetupSource = SaverSetup (*)();
// Creates the CUDA-backed saver on first call; fails (and retries next time) without a driver.
// `defaults`: the process defaults it starts with (take_defaults below), which the api layer reads.
Status default_saver(SetupSource setup, const ProcessDefaults& defaults, SaverHandle* out);
// The process-wide saver's handle, or 0 if it was never created (creates nothing).
SaverHandle existing_default_saver();
Status add_saver(std::unique_ptr<Saver> saver, const ProcessDefaults& defaults, SaverHandle* out);
// Destroys a saver made by add_saver (the process-wide one cannot be removed): from now on
// its handle finds nothing; it is deleted once the calls still using it have returned.
Status remove_saver(SaverHandle handle);
// The live saver a handle names; empty when destroyed or never made.
SaverRef find_saver(SaverHandle handle);
// The saver holding an allocation that starts at va; empty when none does.
SaverRef owner_of(uintptr_t va);

}  // namespace tmsl
