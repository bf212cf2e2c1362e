// The host memory the backup tiers may hold, as an interface handed to them: the node's
// ledger implements it (node_ledger.h); the api layer picks it where savers are made, so
// nothing below reaches for a process-wide object. It also stands for the node's store of
// shared backups (node_store.h), whose chunks the budget counts once.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>

#include "platform/status.h"

namespace tmsl {

class HostBudget {
 public:
  virtual ~HostBudget() = default;
  // Takes `bytes` for this process, or refuses with Code::kOutOfMemory saying why.
  virtual Status reserve(size_t bytes) = 0;
  virtual void give_back(size_t bytes) = 0;
  // How much of what `owner` holds it could give back at once (its host cache).
  virtual void note_cached(const void* owner, size_t bytes) = 0;
  // `give_back` lets `owner`'s cache go when another process needs the room; forget()
  // returns once no call of it runs.
  virtual void on_pressure(const void* owner, std::function<void()> give_back) = 0;
  virtual void forget(const void* owner) = 0;
  // Asks the other processes for their caches; true once `bytes` could be reserved.
  virtual bool ask_others_for(size_t bytes, std::chrono::milliseconds patience) = 0;
  // What could be reserved once the others' caches were given back; SIZE_MAX: no budget.
  virtual size_t room_with_others_caches() = 0;

  // The node's store of shared backups: whether this process shares (TMSL_SHARE_BACKUPS=1);
  // a chunk holding exactly the `size` bytes at `data` opened (*fd holds it until
  // release_shared).
  virtual bool shares_backups() = 0;
  virtual Status share(const char* data, size_t size, int* fd) = 0;
  virtual void release_shared(int fd) = 0;
};

}  // namespace tmsl
