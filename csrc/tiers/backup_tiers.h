// Every host copy of a paused byte and where it goes: the backup tiers, one object the saver
// owns. It holds the copies themselves (host_copies.h: every allocation's host copy, by
// address), the host memory they live in (the pool of page-locked memory nobody holds, fresh
// arenas for a batch), the host cache's budget and its policy (which copies stay after a
// resume, which cached arenas give way, the figure the node's ledger is told: host_cache.cpp),
// the node's budget it is handed (host_budget.h), the spill's choice (which copies a pause
// sends to the disk tier instead: spill_choice.cpp), the copies made of chunks of the node's
// store, which it is handed beside the budget where the process shares (chunk_store.h;
// content_copies.cpp), the background thread that prepares and frees host memory,
// and the gate that makes that thread give way to the foreground (foreground_gate.h). It
// chooses, per batch, where each allocation's copy goes: memory the allocation kept, the
// pool, fresh memory.
//
// The saver keeps the table of allocations and pushes what the tiers need as values at each
// call (addresses, sizes, states, its tags' facts); the tiers never call into the saver.
//
// Locking: its own (the copies', the pool's); never the saver's table lock. Calls that may
// take the node's lock (reserve, ask_others_for, the spill's choice, publish_cache) are made
// without the saver's table lock held.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "node/chunk_store.h"
#include "node/host_budget.h"
#include "platform/backend.h"
#include "platform/status.h"
#include "tiers/backup.h"
#include "tiers/disk_copies.h"
#include "tiers/foreground_gate.h"
#include "tiers/host_copies.h"
#include "tiers/host_pool.h"

namespace tmsl {

// Where one allocation's copy goes in a batch.
enum class Tier {
  kNone,    // no copy (no backup, or released without one)
  kKept,    // the host memory it kept from its last cycle (retained or cached)
  kHost,    // host memory: the pool's, else fresh
  kDisk,    // the disk tier (its files hold the content)
  kContent, // a content arena: chunks of the node's store, new ones copied into
};

// What a batch asks of the tiers for one allocation.
struct CopyRequest {
  int device = 0;
  size_t bytes = 0;       // what its copy holds
  bool cacheable = true;  // false: "mmap" copies, whose memory goes back at resume (never pooled)
  Tier tier = Tier::kHost;
  // Not 0: a soft pause's copy, a soft arena (HostArena::create_soft) of this many bytes (the
  // allocation's reserved ones); where the backend cannot make one, ordinary host memory.
  size_t soft_span = 0;
};

class BackupTiers {
 public:
  // `budget` and `store` outlive it; `store` nullptr: this process does not share (every copy
  // private). `keeps_host_cache` false: its cache starts at 0 bytes (default_cache_bytes).
  BackupTiers(std::shared_ptr<Backend> backend, HostBudget& budget, ChunkStore* store, bool keeps_host_cache);
  ~BackupTiers();  // waits for the background work, frees the pool
  BackupTiers(const BackupTiers&) = delete;
  BackupTiers& operator=(const BackupTiers&) = delete;

  HostBudget& budget() { return budget_; }
  ForegroundGate& gate() { return gate_; }
  BackgroundWork& background() { return background_; }
  HostPool& pool() { return pool_; }
  HostCopies& copies() { return copies_; }
  const HostCopies& copies() const { return copies_; }
  // The disk tier's copies (disk_copies.h): the files of paused allocations.
  DiskCopies& disk_copies() { return disk_copies_; }
  const DiskCopies& disk_copies() const { return disk_copies_; }

  // The host cache's budget: copies kept after a resume and the pool together (0: none).
  size_t cache_bytes() const { return cache_bytes_.load(); }
  void set_cache_bytes(size_t bytes) { cache_bytes_.store(bytes); }
  // The default: an eighth of the host memory this process may use, at most 32 GiB; 0 where
  // it keeps none (TMSL_LIKE_TORCH_MEMORY_SAVER=1, environment.h: the api layer tells).
  static size_t default_cache_bytes(bool keeps_host_cache);
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

  // How many fresh arenas host_memory made (the pool served the rest): what tests observe.
  size_t fresh_arenas() const { return fresh_arenas_.load(); }

  // The host cache's policy (host_cache.cpp). Whether a resume of `batch` keeps its copies:
  // `retain`, or they fit in the cache's budget on their own. The cache holds the newest
  // copies: older cached arenas that leave no room for them go to *older, least recently
  // used first (the caller lets them go). The batch is still moving (CopyState::kMoving).
  bool keep_after_resume(const std::vector<HostCopies::Resumed>& batch, bool retain, std::vector<HostBuffer>* older);
  // Page-locked memory already there, for a pause's requests of tier kHost that may be
  // cached: where the pool lacks bytes on a device and the cache's budget has no room for
  // fresh memory beside what it keeps, whole cached arenas of that device (every copy in
  // them a resident allocation's: stale; none retained, leased or shared) are taken, least
  // recently used first, whatever their tag and shape, and their copies returned; the caller
  // lets them go, and the pool, its limit raised by what the cache no longer keeps, carves
  // them for the pause. Only while no pause is reusing cached copies (the saver's operation).
  std::vector<HostBuffer> take_stale_cache(const std::vector<CopyRequest>& requests);
  // Tells the node's ledger how much host cache could be given back (the whole cached
  // arenas and the pool) and how much of its store this process maps, and lets the pool keep
  // what the budget leaves beside the copies kept.
  void publish_cache();
  // Another process of the node needs the room: gives the whole cache back at once (the pool
  // too), letting `op` (the saver's operation lock, held) go once the copies are taken.
  void give_cache_back(std::unique_lock<std::mutex> op);
  // Runs `attempt` (a foreground request for host memory) again while it fails for want of
  // room: after the pool and this process's cache give way (freed here, at once, least
  // recently used first), then once the other processes' caches have (`bytes`: what it
  // needs). Only while no pause is reusing cached copies (the saver's operation).
  Status with_room(size_t bytes, const std::function<Status()>& attempt);
  // Lets every copy of a resident allocation go (the cache, retained copies) and the pool.
  void release_cache();
  // After the budget was lowered: whole cached arenas go, least recently used first, until
  // the rest fits; the pool lets go of what no longer fits either.
  void fit_cache();

  // The spill's choice (spill_choice.cpp). One allocation of a pause's selection.
  struct SpillCandidate {
    uintptr_t va = 0;
    size_t backup_bytes = 0;  // what its copy would hold
    bool wants_host = false;  // resident and backed up: this pause copies it
  };
  // The vas of the selected allocations that would take new host memory at this pause (no
  // copy of their size kept), largest first, that go to the disk tier instead, until the rest
  // fits in the node's budget with the other processes' host caches and this one's (less the
  // arenas this pause reuses) given back; with `everything`, all of them. Takes the node's
  // lock: not under the saver's table lock.
  std::vector<uintptr_t> choose_spill(const std::vector<SpillCandidate>& selected, bool everything);

  // The node's store (content_copies.cpp). The key chunks are fingerprinted under; nullptr
  // where this process does not share (no store handed, or one that cannot be used).
  const FingerprintKey* content_key() { return store_ != nullptr ? store_->content_key() : nullptr; }
  // The key where a backup offered now goes to the store; nullptr: a private copy (the store
  // asks the budget whether this process is alone on the node: ChunkStore::store_key_now).
  const FingerprintKey* store_key_now() { return store_ != nullptr ? store_->store_key_now(budget_) : nullptr; }
  // A backup that could have gone into the store became a private copy: why (ChunkStore).
  // content_copy notes its own outcome.
  void note_store_refusal(const std::string& why) {
    if (store_ != nullptr) store_->note_refusal(why);
  }
  // The fingerprints of the chunks of [va, va + bytes) on `device`, computed there
  // (Backend::fingerprint); kUnsupported where the device cannot: the pause copies instead.
  // (After the copies before the mark `after`, where given: Backend::fingerprint.)
  Status fingerprint_chunks(int device, uintptr_t va, size_t bytes, const FingerprintKey& key,
                            std::vector<Fingerprint>* out, const CopyMark* after = nullptr);
  // A copy of `bytes` on `device` whose chunks (HostArena::chunks_in(bytes) of them, kRangeBytes
  // each) have the fingerprints `chunks`, in a content arena: the chunks the store has are
  // taken as they are, the others made new for the pause to copy into (*new_bytes: theirs).
  // Takes room for the new ones as host_memory does (the pool and the caches give way), where
  // `make_room`.
  Status content_copy(int device, size_t bytes, const std::vector<Fingerprint>& chunks, HostBuffer* out,
                      size_t* new_bytes, bool make_room = true);
  // Pending chunk `index` of a content arena (another process was making it): settled once
  // the store has it; made new here (*made: the caller copies into it and publishes) where
  // nobody makes it any more, or past `deadline` (one for a whole pause: kPatienceForChunks).
  Status wait_for_chunk(HostArena& arena, size_t index, const Fingerprint& f,
                        std::chrono::steady_clock::time_point deadline, bool* made);
  static constexpr std::chrono::milliseconds kPatienceForChunks{30000};
  // After a claim of `f` (*claim) had where the store had no chunk of it: the chunk, held in
  // *fd, if another process named it meanwhile (the claim let go, *claim -1); else *fd -1.
  Status taken_if_named_meanwhile(int* fd, const Fingerprint& f, int* claim);
  // How long a pause whose content changed waits for the other holders of its old chunks to
  // let go of them (replicas pausing new weights at about the same time: each chunk's maker
  // then rewrites it in place, at the link's speed, HostArena::recycle), and a holder for a
  // maker to claim the new bytes; past it, new chunks are made (fresh memory, page-locked
  // 4 KiB page by page: 6-41 % of the link's speed measured on an H200 node). Paid once where the others do not
  // pause (the next pause's chunks are its own). Tests set it longer, so that no timing can
  // decide what they check.
  static constexpr std::chrono::milliseconds kPatienceForReplicas{100};
  std::chrono::milliseconds patience_for_replicas() const { return std::chrono::milliseconds(replica_patience_ms_.load()); }
  void set_patience_for_replicas(std::chrono::milliseconds patience) { replica_patience_ms_.store(patience.count()); }
  // The saver is going: background passes and preparations stop.
  void close() { closing_.store(true); }
  bool closing() const { return closing_.load(); }

  // How long a pause refused for want of room waits for the other processes' caches.
  static constexpr std::chrono::milliseconds kPatienceForOthers{2000};

 private:
  std::shared_ptr<Backend> backend_;
  HostBudget& budget_;
  ChunkStore* const store_;  // nullptr: this process does not share
  std::atomic<size_t> cache_bytes_;
  std::atomic<size_t> fresh_arenas_{0};
  std::atomic<size_t> published_cache_{0};  // what the node's ledger was last told
  std::atomic<size_t> published_shared_{0};  // and of the store's bytes this process maps
  std::atomic<bool> closing_{false};
  std::atomic<int64_t> replica_patience_ms_{kPatienceForReplicas.count()};
  ForegroundGate gate_;
  BackgroundWork background_;  // after the gate: its tasks wait on it
  HostPool pool_;              // after the background work: it frees there
  HostCopies copies_;          // after the pool: its arenas come back there when it goes
  DiskCopies disk_copies_;
};

}  // namespace tmsl
