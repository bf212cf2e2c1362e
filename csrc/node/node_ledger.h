// One host-memory budget for every process of the node (or container) that uses the library.
//
// The ledger is a small file in shared memory (/dev/shm/torch_mem_saver_lite-<uid>.v2.ledger,
// and a container has its own /dev/shm; TMSL_HOST_LEDGER names another file) holding the
// budget and, per process, the host memory its
// backups and host cache hold. Every host arena takes its bytes from the ledger before it
// maps anything and gives them back when it goes, so the processes' backups together never
// exceed the budget. Updates hold an flock on the file, which the kernel drops when its
// holder dies. Each process owns its slot through a record lock on the slot's bytes, which the
// kernel drops when the process dies (kill -9 included) and a forked child does not inherit:
// the share of a process that died is taken back by the next process that needs room (its
// memory went with it), also across PID namespaces that share /dev/shm.
//
// The file is opened only if it is this user's regular file that nobody else may write (no
// symbolic link followed), and never mapped: each update reads it whole and writes it back
// under the flock, so a file cut short by anyone (truncate) costs no process a SIGBUS; it is
// made whole again, and each process writes its own entry back from what it knows. A process
// whose ledger was removed or replaced (systemd-logind's RemoveIPC, a /dev/shm cleaner) moves
// to the file at the path, made if need be, and publishes what it holds there, at its next
// update or within a quarter second (its ledger thread looks), so a newcomer sees it.
//
// A process refused for want of room asks the others to give their host caches back: it bumps
// a counter in the ledger and wakes them (a futex on the shared word); each process that
// keeps a cache has a thread waiting there, which lets its caches go.
//
// The budget is the node's: set once it applies to every process. A process started with
// TMSL_HOST_MEMORY_BUDGET (bytes, or with a K/M/G/T suffix) sets it, as set_budget does; until
// one does, it is half of the host memory the process opening the ledger may use
// (host_memory_limit: the machine's memory, what is available and the container's limit,
// whichever is least), worked out again whenever a process opens it with nobody holding a share.
//
// The node's store of shared backups (node_store.h) holds bytes for all its processes at once:
// the ledger counts them once, beside the processes' own, knowing the store only as those bytes
// (shared_holdings.h). The api layer makes both, one per process (api/node_budget.h), and hands
// the ledger its settings (Settings, from the process defaults) and the store to count.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "node/host_budget.h"
#include "node/shared_holdings.h"
#include "platform/status.h"

namespace tmsl {

class NodeLedger final : public HostBudget {
 public:
  // What the api layer reads for it from the process defaults (environment.h).
  struct Settings {
    std::string path;  // TMSL_HOST_LEDGER, else path_for("")
    size_t budget = 0;  // TMSL_HOST_MEMORY_BUDGET (0: not set)
    std::string budget_error;  // what is wrong with that variable ("": nothing): no budget applies
    // false: the budget does not limit this process (TMSL_LIKE_TORCH_MEMORY_SAVER=1 without a
    // budget of its own), though what it holds is still in the ledger for the others to see.
    bool budget_applies = true;
  };
  // The ledger file at `named`, or the default one where "" (in /dev/shm, this user's).
  static std::string path_for(const std::string& named);
  // Opens the ledger at settings.path, taking this process's slot, and counts `held_once`'s
  // bytes (the node's store; nullptr: nothing) in the budget, after collecting its garbage. A
  // ledger that cannot be opened leaves budgets off (every reservation succeeds); the reason
  // is kept for host_memory(). Never destroyed (arenas may go at exit); a forked child makes
  // one of its own, its copy of this one left (leave_after_fork).
  NodeLedger(const Settings& settings, SharedHoldings* held_once);
  ~NodeLedger() override;  // (only the one of two made at once that is not kept)
  void leave_after_fork();  // in a forked child, right after fork: no slot, no file

  // Takes `bytes` for this process, or refuses with Code::kOutOfMemory (naming the budget,
  // what was asked for and who holds what) when the node's processes would exceed the budget.
  Status reserve(size_t bytes) override;
  void give_back(size_t bytes) override;
  // How much of what `owner` (a saver) holds it could give back at once (its host cache);
  // the process's total is shown to the others.
  void note_cached(const void* owner, size_t bytes) override;
  // How much of the node's store `owner` maps; the process's total is shown to the others.
  void note_shared(const void* owner, size_t bytes) override;

  // `give_back` gives `owner`'s host cache back; it is called, on a thread of the ledger's,
  // when another process of the node needs the room. forget() returns once no call of it runs.
  void on_pressure(const void* owner, std::function<void()> give_back) override;
  void forget(const void* owner) override;
  // Asks the node's other processes to give their host caches back, and waits up to
  // `patience` until `bytes` could be reserved; true when they could.
  bool ask_others_for(size_t bytes, std::chrono::milliseconds patience) override;
  // What could be reserved now once the other processes' host caches were given back;
  // SIZE_MAX where no budget applies.
  size_t room_with_others_caches() override;
  // Whether no other live process of the node holds a slot (each takes one when its ledger
  // opens, before it holds anything); false with no ledger, in a forked child's copy, or where
  // the file cannot be read: nobody to tell apart.
  bool alone_on_node() override;

  struct Holder {
    size_t entry;  // the process's entry in the ledger: unique while it lives
    pid_t pid;     // as the process saw itself (pids of other pid namespaces may repeat)
    size_t bytes, cached;
    bool this_process;
    size_t shared;  // bytes of the node's store it maps (its copies held once by the node)
  };
  struct Figures {
    bool active = false;     // false: no ledger (error says why); no budget applies
    std::string path, error;
    size_t budget = 0;       // bytes, for the whole node
    size_t held_here = 0;    // by this process
    size_t held_by_others = 0;
    std::vector<Holder> holders;  // every process holding some, this one included
    size_t shared = 0;       // the node's shared backups (what it was handed to count), counted once
  };
  Figures figures();
  // The ledger file's path ("" when none could be opened).
  const std::string& path() const { return path_; }
  // Sets the node's budget (0 is refused: use release_host_cache to hold nothing); it applies
  // to this process from then on, also where TMSL_LIKE_TORCH_MEMORY_SAVER=1 left it without.
  Status set_budget(size_t bytes);

 private:
  struct Shared;
  struct Slot;
  // Runs `body` with the file locked (flock) and this process's slot found or made.
  template <typename Body>
  Status locked(Body&& body);
  void open_shared(size_t budget_from_env);  // reads the file, made or checked under its flock
  // The ledger at path_, opened only as this user's regular file nobody else may write; -1
  // (*why says why) otherwise.
  int open_private(std::string* why) const;
  Status load();   // under the flock: the file into *shared_, made whole if cut short
  Status store();  // under the flock: *shared_ written back
  bool stale() const;  // under mu_: the path names another file (or none), or the file was cut short
  void follow_path();  // under mu_: moves to the file the path names now
  void watch_in_background();         // starts watch() once
  uint32_t pressure_now();            // the file's pressure counter
  Slot* my_slot();                    // under the lock; takes a free slot the first time
  bool alive(size_t index) const;     // whether a process holds slot `index`'s record lock
  bool nobody_alive() const;          // under the lock
  bool others_alive() const;          // under the lock: a live process besides this one holds a slot
  void forget_dead_processes();       // under the lock
  size_t total_held() const;          // under the lock: the processes' and the shared store's
  std::string holders_text() const;   // under the lock

  void watch();  // the pressure thread: gives the caches back when another process asks
  // Whether `bytes` could be reserved now; *others_cached: what the other processes could give back.
  bool fits(size_t bytes, size_t* others_cached);

  std::mutex mu_;  // the threads of this process, around the file lock
  std::map<const void*, size_t> cached_;  // per saver, under mu_
  std::map<const void*, size_t> shared_by_;  // per saver, under mu_
  std::mutex givers_mu_;  // held while a give_back runs
  std::map<const void*, std::function<void()>> givers_;
  bool watching_ = false;  // under givers_mu_
  int fd_ = -1;  // under mu_ once opened
  std::unique_ptr<Shared> image_;  // the file's content as last read, under mu_
  Shared* shared_ = nullptr;       // image_ once the ledger opened; nullptr: no ledger
  std::atomic<uint32_t*> pressure_word_{nullptr};  // the file's pressure word, mapped for futex calls only
  bool loaded_ = false;  // the file was read once: one cut short is this ledger, made whole
  uint64_t my_held_ = 0, my_cached_ = 0;  // this process's entry as it knows it (the file may lose it)
  uint32_t my_shared_mib_ = 0;
  uint64_t budget_seen_ = 0;       // the budget as last read, for a file made again
  uint32_t explicit_seen_ = 0;
  pid_t owner_ = 0;  // the process that opened it: a forked child neither takes nor gives
  int slot_ = -1;    // this process's slot, once it took one
  uint64_t start_time_ = 0;
  std::string path_, error_;
  SharedHoldings* const held_once_;  // the node's store, counted once (nullptr: nothing)
  // Whether the budget limits this process (TMSL_LIKE_TORCH_MEMORY_SAVER=1 without a budget
  // of its own: not, as torch_memory_saver's backups take what they need; what it holds is
  // still in the ledger for the others to see).
  std::atomic<bool> budget_applies_{true};
  // This process took its slot when the ledger opened, so that the others see it before it
  // holds anything (whether a pause is alone is told by the slots: alone_on_node()); a ledger
  // made again gets it back at once.
  bool joined_ = false;
};

}  // namespace tmsl
