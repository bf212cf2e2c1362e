// The host memory the backup tiers may hold, as an interface handed to them: the node's
// ledger implements it (node_ledger.h); the api layer makes it where savers are made
// (api/node_budget.h), so nothing below reaches for the ledger itself. The node's store of
// shared backups is another interface (chunk_store.h), handed beside it; the budget counts the
// store's chunks once, beside what each process holds.
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
  // How much of the node's store `owner` maps (its copies held once by the node): shown beside
  // what it holds, so that the node's figures say which processes share the store's bytes.
  virtual void note_shared(const void* owner, size_t bytes) = 0;
  // `give_back` lets `owner`'s cache go when another process needs the room; forget()
  // returns once no call of it runs.
  virtual void on_pressure(const void* owner, std::function<void()> give_back) = 0;
  virtual void forget(const void* owner) = 0;
  // Asks the other processes for their caches; true once `bytes` could be reserved.
  virtual bool ask_others_for(size_t bytes, std::chrono::milliseconds patience) = 0;
  // What could be reserved once the others' caches were given back; SIZE_MAX: no budget.
  virtual size_t room_with_others_caches() = 0;
  // Whether no other live process of the node uses the library now, as far as the budget can
  // tell: false where it cannot (no ledger, a forked child's copy, a ledger that cannot be
  // read). Whether a pause has anybody to share its backups with (ChunkStore::store_key_now).
  virtual bool alone_on_node() = 0;
};

}  // namespace tmsl
