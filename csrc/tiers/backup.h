// Host memory that holds the content of paused allocations.
//
// A pause takes one HostArena for all the backups it needs and carves it into one
// HostBuffer per allocation; so does Saver::prepare_backups, ahead of the first pause, in
// the background. The arena is page-locked in ranges of about kRangeBytes, each
// one registration: small buffers are packed into a range, a larger buffer gets ranges of
// its own. Worker threads fault the pages in, 64 MiB at a time and with transparent huge
// pages, while one more thread page-locks the ranges in order as their pages arrive; a copy
// starts as soon as its range is ready, so preparing host memory overlaps the transfers and
// no large backup waits for all of its memory to be page-locked first.
//
// One CUDA copy may not cross from one registration into the next (the driver answers
// "invalid value"), so copies go range by range (for_each_part), and a buffer users copy
// from with torch (get_cpu_backup(zero_copy=True)) is first made one registration
// (register_as_one). A pooled arena (host_pool.h) may be carved again into buffers of any
// sizes at any page of its ranges (spans()). Its bytes are taken from the budget it
// is handed (host_budget.h) and given back when it goes; a content arena is handed the node's
// store too (chunk_store.h), whose chunks it maps. Its workers give way to the
// foreground (foreground_gate.h) unless it is urgent: a pause waits for it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "node/chunk_store.h"
#include "node/host_budget.h"
#include "platform/backend.h"
#include "platform/fingerprint.h"
#include "tiers/foreground_gate.h"
#include "platform/status.h"

namespace tmsl {

class HostArena {
 public:
  // Size of a page-locked range: small enough that the first copies start early, large
  // enough that registrations stay few (a range of packed small buffers may reach twice this).
  static constexpr size_t kRangeBytes = 64 << 20;
  // Pages are faulted in by the workers in pieces of at most this size.
  static constexpr size_t kPieceBytes = 64 << 20;

  // Maps memory for buffers of the given sizes and starts preparing it; fails with
  // Code::kOutOfMemory when the host or `budget` cannot provide it. The arena shares the
  // backend (a backup leased out may outlive its saver); `budget` and `gate` outlive it.
  // Not `urgent`: prepared ahead, its workers wait for a quiet foreground until hurry().
  static Status create(std::shared_ptr<Backend> backend, HostBudget& budget, ForegroundGate& gate, bool urgent,
                       int device, const std::vector<size_t>& buffer_sizes, std::unique_ptr<HostArena>* out);
  // A content arena: one buffer of `size` bytes (a multiple of the page) for one allocation's
  // copy, whose ranges (kRangeBytes each, the last shorter: chunks_in(size) of them) are
  // chunks of the node's store `store` (chunk_store.h), chunks[i] for range i. A chunk the store has
  // (fd held open by open_chunk) is mapped read-only as it is: no memory of this process, no
  // copy. A new one (fd -1) is made here, a file the pause copies into and publish() names,
  // its bytes taken from `budget` until then (private memory instead where its file gets no
  // pages). It never goes to the pool; a named chunk is never written again, but for one this
  // process made and alone holds, taken back by recycle() for its allocation's new bytes (a
  // lease makes its ranges private first). A chunk another process is making
  // (`pending`) is left unmapped until settle_chunk or make_chunk. Takes the fds and claims,
  // on failure too. Urgent when some chunk is new (the pause copies into it); otherwise its
  // page-locking gives way.
  struct Chunk {
    Fingerprint fingerprint;
    int fd = -1;        // the store's chunk, held
    int claim = -1;     // a new chunk's claim (node_store.h), let go once it is published
    bool pending = false;
    bool own = false;   // a new chunk never named: this process holds or makes those bytes already
  };
  static size_t chunks_in(size_t size) { return (size + kRangeBytes - 1) / kRangeBytes; }
  static Status create_content(std::shared_ptr<Backend> backend, HostBudget& budget, ChunkStore& store,
                               ForegroundGate& gate, int device,
                               size_t size, const std::vector<Chunk>& chunks, std::unique_ptr<HostArena>* out);
  // A soft arena (soft_arena.cpp): one buffer of `size` bytes (a multiple of the device's
  // granularity: an allocation's reserved bytes) of host memory the GPU maps like its own
  // (Backend::create_host_physical), one handle per range of kRangeBytes (the last shorter),
  // mapped here for the host and the device. While its allocation is paused, map_at puts the
  // same handles at the allocation's own address, so a kernel touching it reads and writes this
  // copy (a soft pause). Page-locked as made: no workers, no registration. Never pooled (its
  // handles fit its allocation alone).
  static Status create_soft(std::shared_ptr<Backend> backend, HostBudget& budget, ForegroundGate& gate, int device,
                            size_t size, std::unique_ptr<HostArena>* out);
  bool is_soft() const { return soft_; }
  // Queues, on the device's copy stream, the copy of `n` bytes of device memory at `va` into
  // its memory at `host` (a place for_each_part gave), or back (copy_out), as its kind takes
  // it: a soft arena's memory is host memory the device maps, so a copy between two device
  // ranges; any other's a copy to or from page-locked host memory.
  Status copy_in(int device, char* host, uintptr_t va, size_t n) const {
    return soft_ ? backend_->copy_async(device, reinterpret_cast<uintptr_t>(host), va, n)
                 : backend_->copy_to_host_async(device, host, va, n);
  }
  Status copy_out(int device, uintptr_t va, const char* host, size_t n) const {
    return soft_ ? backend_->copy_async(device, va, reinterpret_cast<uintptr_t>(host), n)
                 : backend_->copy_from_host_async(device, va, host, n);
  }
  // Maps its handles at [va, va + size()) for the device as well (undone on failure): those
  // of its ranges that start in [from, to).
  Status map_at(uintptr_t va, size_t from = 0, size_t to = SIZE_MAX);
  // Takes the ranges that start in [from, to) off there again, each tried (the first failure
  // said; *failed, where given, gets each failed range's (offset, bytes): still mapped, for the
  // caller to retry); *end (where given): where the last of them ends.
  Status unmap_at(uintptr_t va, size_t from = 0, size_t to = SIZE_MAX, size_t* end = nullptr,
                  std::vector<std::pair<size_t, size_t>>* failed = nullptr);
  ~HostArena();  // waits for its workers, unregisters, unmaps
  // Marks memory a forked child must not get (MADV_DONTFORK); faults pages in by writing them
  // (those of `file` at `in_file`, -1 for anonymous memory, allocated in the file first: false
  // where it has no room, which `store`, the file's, tells).
  static void keep_from_children(void* at, size_t size);
  static bool fault_in_pages(char* at, size_t size, int file, size_t in_file, ChunkStore* store);
  // Gives its pages back range by range, each once the foreground is quiet: the background's
  // way of freeing it. Unpinning and freeing gigabytes at once holds the driver's lock and
  // the process's memory map for a tenth of a second, which an allocation or a copy starting
  // meanwhile would wait for. The address range stays mapped (empty) until the destructor,
  // so nothing else can be placed in it meanwhile. Shared ranges are the destructor's.
  void give_back_gently();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // The bytes its buffers occupy: the mapping less the gaps that align a large buffer's
  // ranges, which are never touched. What the node's budget and the host cache count.
  size_t used_bytes() const { return used_; }
  // [start, end) of each run of ranges without a gap: where buffers may be carved anew.
  std::vector<std::pair<size_t, size_t>> spans();
  int device() const { return device_; }
  // A foreground operation waits for it: its workers stop giving way.
  void hurry();
  // Returns once every range is faulted in and page-locked (or has failed to be).
  void wait_prepared();
  size_t buffer_offset(size_t i) const { return buffer_offsets_[i]; }
  // When a pause last took buffers of it (a count, not a time): the host cache gives the
  // least recently used arenas back first.
  uint64_t last_use() const { return last_use_.load(); }
  void note_use();
  // Calls part(offset, size) for each piece of [offset, offset + size) that lies in one
  // registration, in order, each once it is page-locked; stops at the first error.
  Status for_each_part(size_t offset, size_t size, const std::function<Status(size_t, size_t)>& part);
  // Makes [offset, offset + size), a buffer's span, one registration, so that a single copy
  // may cover it. Waits until the whole arena is prepared. No for_each_part may run on any
  // buffer of the arena meanwhile (the saver serializes both under its operation lock).
  // Shared ranges in the span are made this process's own first (node_store.h): a lease may
  // be written. Counts a live lease until end_lease().
  Status register_as_one(size_t offset, size_t size);
  // A lease register_as_one counted is let go of (the user's tensor is gone).
  void end_lease();

  // A content arena's: names its new chunks in the store once the pause's copies into them
  // have landed (their bytes go from this process's budget to the store's); a chunk whose
  // bytes another process named first stays this process's own. Any other arena: nothing.
  void publish();
  // Lets go of the claims of new chunks not yet named (a pause that failed: the processes
  // waiting for them make them themselves at once, and a retry here claims them again).
  void drop_claims();
  // The chunks another process was making when the arena was made.
  std::vector<size_t> pending_chunks();
  // Pending chunk `index` is in the store now (fd held): mapped in, read-only. A retired one
  // that came back as the same file (rewritten in place) stays mapped as it is; another file
  // is mapped in its place, page-locked at its first copy.
  Status settle_chunk(size_t index, int fd);
  // Pending chunk `index` is nobody's to make any more: made here, new, for the caller to copy
  // into and publish (`claim`: its claim, or -1); a retired one's file is let go of first.
  Status make_chunk(size_t index, int claim);
  // A content arena of this allocation's last cycle, whose bytes changed (`content`, each
  // chunk's): its changed chunks become new chunks for the pause to copy into and publish,
  // where this process made them and the store has none of the new bytes (the weights after
  // a training step: no fresh memory, no new page-locking, none taken twice). A chunk other
  // processes hold too is rewritten in place only once none of them needs its bytes: replicas
  // whose weights changed alike pause at about the same time, and each lets go of the old
  // bytes of the chunks it did not make (retired: still mapped and page-locked, pending until
  // their makers name the new bytes, settle_chunk) while each maker waits for the others to
  // let go of its own, until `others_by`. A leased arena's chunks all count as changed (a user
  // may have written them), and are never rewritten while others hold them. false where a
  // chunk cannot be had so (still held by others at `others_by`, or the store has its new
  // bytes as another file): the caller lets the arena go and copies anew.
  bool recycle(const std::vector<Fingerprint>& content, std::chrono::steady_clock::time_point others_by);
  // recycle()'s way for one piece of a content arena of the last cycle, while the rest is still
  // being fingerprinted (`content`: the fingerprints of chunks first, first + 1, ...): each
  // changed chunk this process alone holds, whose new bytes the store does not have, is taken
  // back and given its new fingerprint, for the caller to copy into at once; the taken chunks
  // are returned. *all: whether every changed chunk of the piece was taken; where not (a chunk
  // replicas hold, the store's bytes, a leased arena), the caller stops here and recycle() takes
  // what is left (the chunks taken here count as unchanged there). Their copies are the
  // caller's: writable_parts() leaves them out until publish(); forget() where one could not
  // be queued.
  std::vector<size_t> take_in_place(size_t first, const std::vector<Fingerprint>& content, bool* all);
  // Chunk `index`, taken by take_in_place(), whose copy could not be queued: its bytes are
  // unknown (no fingerprint matches it any more) and a later recycle() copies it.
  void forget(size_t index);
  // Until when the maker of pending chunk `index`, retired by recycle(), may still claim its
  // new bytes (a replica pausing a little later): a waiter makes the chunk itself only after.
  std::chrono::steady_clock::time_point maker_expected_until(size_t index);
  // A content arena's fingerprints, chunk by chunk, while its bytes are still theirs (never
  // leased); empty for any other arena.
  std::vector<Fingerprint> content();
  bool is_content() const { return !content_.empty(); }
  // A content arena's chunk `index`'s fingerprint (fixed when it was made).
  const Fingerprint& chunk_fingerprint(size_t index) const { return content_[index]; }
  // The parts of the buffer at [offset, offset + size) a pause copies into, as (offset in the
  // buffer, bytes): all of it, or a content arena's new chunks only (the store's hold their
  // bytes already, and are never written).
  std::vector<std::pair<size_t, size_t>> writable_parts(size_t offset, size_t size);
  // Whether any range is a chunk of the store: its memory must never be written.
  bool has_shared() const { return shared_ranges_.load() != 0; }
  // Whether the files of the store's chunks mapped at [offset, offset + size) still hold
  // their ranges' bytes. Any process of this user can cut a chunk short under its holders
  // (truncate), and so can a cleaner of /dev/shm: its bytes are gone, and touching its mapping
  // past the file's new end is a SIGBUS. *cut (where given): which one, and how short, for the
  // user. Every other range is always whole.
  bool intact(size_t offset, size_t size, std::string* cut = nullptr);
  bool intact() { return intact(0, size_); }
  // The memory it holds that is this process's own, not the store's.
  size_t own_bytes() const { return used_ - shared_bytes_.load(); }
  // Whether its memory may serve other buffers once nobody holds it: an ordinary arena
  // (not a content arena) never leased (a user may hold its address).
  bool poolable();

 private:
  struct Range {
    size_t start = 0;
    size_t size = 0;
    size_t pieces_left = 0;
    bool done = false;
    bool registered = false;  // false once done: page-locking failed, tried again at its copy
    int shared_fd = -1;       // a chunk of the node's store mapped here (read-only but its own)
    int new_fd = -1;          // a new chunk of a content arena mapped here, not named (yet)
    int claim_fd = -1;        // the claim of that new chunk, let go once it is published
    bool pending = false;     // a chunk another process makes: not mapped yet
    bool own = false;         // a new chunk that is never published (Chunk::own)
    bool no_room = false;     // a new chunk's file could not get its pages: nothing may touch them
    bool counted = false;     // its bytes given back to the node's budget (the store counts them)
    bool made_here = false;   // its chunk's file was made by this process (open for writing)
    bool retired = false;     // pending, its old chunk still mapped for its maker to rewrite (recycle)
    bool copy_queued = false; // taken by take_in_place(): its copy is the caller's, queued already
  };
  struct Piece {
    size_t range;
    size_t start;
    size_t size;
  };

  HostArena(std::shared_ptr<Backend> backend, HostBudget& budget, ChunkStore* store, ForegroundGate& gate, bool urgent, int device,
            const std::vector<size_t>& buffer_sizes);
  void start_workers();  // the registrar and the workers that fault pages in (or does it all here)
  void release_soft();   // a soft arena's handles and address range, given back (the destructor's)
  void give_way();  // before a step of a worker's: waits for a quiet foreground unless urgent
  void start_range(size_t at);
  void fault_in();         // a worker: faults pieces in, in order
  void page_lock();        // the registrar: page-locks each range, in order, once its pages are in
  size_t range_index(size_t offset) const;  // the range holding offset; mu_ held
  bool range_intact(size_t r, std::string* cut) const;  // (intact(): range r); mu_ held
  // A shared range made private again (its bytes read from its chunk; taken from the budget
  // again if they had been given back). mu_ held.
  Status unshare(Range& range);
  // A shared range that is a chunk this process made and alone holds, taken back from the
  // store: unnamed, its own again, no copy (false where another process made it or holds it,
  // or where the budget has no room for its bytes; `reserved`: the caller took them from the
  // budget already). mu_ held.
  bool take_back(Range& range, bool reserved = false);
  // A changed range's old file, mapped and page-locked here, replaced by `fd` (another file,
  // read-only) or by nothing (fd -1: the caller maps a new one): its page-locking undone
  // first. mu_ not held.
  Status replace_retired(Range& range, int fd);
  // register_as_one's two ways (mu_ held): an ordinary arena's ranges of one buffer merged
  // into one registration; a content arena's buffer (all of it) registered as one, its ranges
  // kept as the chunks they are.
  Status register_ranges_as_one(size_t offset, size_t size);
  Status register_content_as_one();
  void reregister_ranges();  // every range not page-locked tried again (after a failed merge)
  // Private memory mapped over [at, at + size), in place of a new chunk's file that got no
  // pages, faulted in (false where even that fails).
  static bool private_memory_at(char* at, size_t size);
  bool stopping() const;  // the arena is going, or the process is ending

  const std::shared_ptr<Backend> backend_;
  HostBudget& budget_;
  ChunkStore* const store_;  // a content arena's (its chunks'); nullptr for the others
  ForegroundGate& gate_;
  std::atomic<bool> urgent_;
  const int device_;
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
  const std::vector<size_t> buffer_sizes_;
  std::vector<size_t> buffer_offsets_;
  std::vector<Range> ranges_;
  std::vector<Piece> pieces_;
  std::atomic<size_t> next_piece_{0};
  std::atomic<bool> stopping_{false};  // the arena is going: workers stop early
  std::atomic<uint64_t> last_use_{0};
  bool reserved_ = false;  // its bytes are taken from the node's budget (node_ledger.h)
  std::atomic<size_t> shared_bytes_{0};  // of them, in the node's store now (given back)
  std::atomic<int> shared_ranges_{0};    // ranges mapping a chunk of the store
  bool soft_ = false;  // a soft arena: data_ is a range of the backend's, mapping soft_handles_
  std::vector<PhysicalHandle> soft_handles_;  // range by range, as made
  size_t soft_mapped_ = 0;  // of them, those mapped at data_
  bool leased_ = false;  // register_as_one ran: a user may hold its memory; its content is no longer known
  std::atomic<int> live_leases_{0};  // leases a user still holds (register_as_one, end_lease)
  bool whole_registered_ = false;    // a content arena's ranges page-locked as one (register_content_as_one)
  std::vector<Fingerprint> content_;  // a content arena's, range by range
  bool filled_ = false;               // a content arena's copies landed (publish ran): nothing is written again
                                      // (until recycle() takes changed chunks back)
  size_t ranges_left_ = 0;  // not yet done
  std::chrono::steady_clock::time_point makers_expected_until_{};  // recycle()'s others_by
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::thread> workers_;
};

// One allocation's backup: a slice of an arena.
struct HostBuffer {
  std::shared_ptr<HostArena> arena;
  size_t offset = 0;
  size_t size = 0;

  explicit operator bool() const { return arena != nullptr; }
  char* data() const { return arena->data() + offset; }
  // part(host, offset in the buffer, size) for each piece of [from, from + bytes) in the
  // buffer that lies in one registration, once it is page-locked, in order.
  Status for_each_part(size_t from, size_t bytes, const std::function<Status(char*, size_t, size_t)>& part) const {
    return arena->for_each_part(offset + from, bytes,
                                [&](size_t at, size_t n) { return part(data() + at - offset, at - offset, n); });
  }
  Status for_each_part(const std::function<Status(char*, size_t, size_t)>& part) const {
    return for_each_part(0, size, part);
  }
};

// Work done off the caller's thread, one task at a time in order: freeing backups
// (unpinning and unmapping gigabytes takes a good part of a second that a resume need not
// wait for) and setting host memory aside for the backups of a tag just allocated.
class BackgroundWork {
 public:
  BackgroundWork();
  ~BackgroundWork();  // runs what is queued, then stops
  // Runs `task` on the background thread; on the caller's thread when there is none (a
  // thread limit, a forked child).
  void run(std::function<void()> task);
  // Frees the buffers in the background.
  void release(std::vector<HostBuffer> buffers);
  // Runs task(true) in the background once `gate` says the foreground is quiet (at once
  // when the work is stopping); task(false) on the caller's thread where there is no
  // background thread.
  void run_after_foreground(ForegroundGate& gate, std::function<void(bool in_background)> task);
  void wait_idle();  // returns once everything handed over has run

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::atomic<bool> stopping_flag_{false};  // stopping_, read without the lock
  std::thread worker_;
};

}  // namespace tmsl
