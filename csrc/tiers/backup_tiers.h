// Every host copy of a paused byte and where it goes: the backup tiers, one object the saver
// owns. It holds the host memory (the pool of page-locked memory nobody holds, fresh arenas
// for a batch), the host cache's budget, the node's budget it is handed (host_budget.h), the
// background thread that prepares and frees host memory, and the gate that makes that thread
// give way to the foreground (foreground_gate.h). It chooses, per batch, where each
// allocation's copy goes: memory the allocation kept, the pool, fresh memory; the budget's
// spill decision says which go to the disk tier instead.
//
// Locking: its own (the pool's); never the saver's table lock, and it never calls into the
// saver. Calls that may take the node's lock (reserve, ask_others_for) are made without the
// saver's table lock held.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include "node/host_budget.h"
#include "platform/backend.h"
#include "platform/status.h"
#include "tiers/backup.h"
#include "tiers/foreground_gate.h"
#include "tiers/host_pool.h"

namespace tmsl {

// Where one allocation's copy goes in a batch.
enum class Tier {
  kNone,    // no copy (no backup, or released without one)
  kKept,    // the host memory it kept from its last cycle (retained or cached)
  kHost,    // host memory: the pool's, else fresh
  kDisk,    // the disk tier (its files hold the content)
};

// What a batch asks of the tiers for one allocation.
struct CopyRequest {
  int device = 0;
  size_t bytes = 0;       // what its copy holds
  bool cacheable = true;  // false: "mmap" copies, whose memory goes back at resume (never pooled)
  Tier tier = Tier::kHost;
};

class BackupTiers {
 public:
  BackupTiers(std::shared_ptr<Backend> backend, HostBudget& budget);
  ~BackupTiers();  // waits for the background work, frees the pool
  BackupTiers(const BackupTiers&) = delete;
  BackupTiers& operator=(const BackupTiers&) = delete;

  HostBudget& budget() { return budget_; }
  ForegroundGate& gate() { return gate_; }
  BackgroundWork& background() { return background_; }
  HostPool& pool() { return pool_; }

  // The host cache's budget: copies kept after a resume and the pool together (0: none).
  size_t cache_bytes() const { return cache_bytes_.load(); }
  void set_cache_bytes(size_t bytes) { cache_bytes_.store(bytes); }
  // The default: an eighth of the host memory this process may use, at most 32 GiB.
  static size_t default_cache_bytes();
  // The copies kept after resumes hold `bytes` of the cache: the pool keeps at most the rest
  // (`now`: what it lets go is freed here, not in the background).
  void note_kept(size_t bytes, bool now = false);

  // Host memory for the requests of tier kHost (out[i] for requests[i]; others untouched):
  // the pool's first, then one fresh arena per kind (cacheable or not) for the rest.
  // `urgent`: a pause waits for it; otherwise it is prepared ahead and gives way to the
  // foreground. kOutOfMemory (nothing taken) when the budget or the host refuses the rest.
  Status host_memory(const std::vector<CopyRequest>& requests, bool urgent, std::vector<HostBuffer>* out);
  // The bytes of `need` (new host memory a pause would take) the budget cannot hold even
  // with the other processes' caches and `cache_given_back` of this one's given back: what
  // the spill sends to the disk tier. `everything`: all of it.
  size_t spill_shortfall(size_t need, size_t cache_given_back, bool everything);

  // How long a pause refused for want of room waits for the other processes' caches.
  static constexpr std::chrono::milliseconds kPatienceForOthers{2000};

 private:
  std::shared_ptr<Backend> backend_;
  HostBudget& budget_;
  std::atomic<size_t> cache_bytes_{default_cache_bytes()};
  ForegroundGate gate_;
  BackgroundWork background_;  // after the gate: its tasks wait on it
  HostPool pool_;              // after the background work: it frees there
};

}  // namespace tmsl
