// Content arenas (backup.h): a copy made of chunks of the node's store, each mapped at its
// range of one buffer: the store's chunks as they are (read-only), new ones as files the
// pause copies into and names once their bytes are in (publish), and chunks another process
// is making settled (or made here) once the pause has named its own.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "tiers/backup.h"

namespace tmsl {

Status HostArena::create_content(std::shared_ptr<Backend> backend, HostBudget& budget, ChunkStore& store,
                                 ForegroundGate& gate, int device,
                                 size_t size, const std::vector<Chunk>& chunks, std::unique_ptr<HostArena>* out) {
  bool any_new = false;
  for (const Chunk& chunk : chunks) any_new = any_new || chunk.fd < 0;
  std::unique_ptr<HostArena> arena(new HostArena(std::move(backend), budget, &store, gate, any_new, device, {size}));
  HostArena& a = *arena;
  // From here on the arena holds the chunks: its destructor lets go of them, whatever fails.
  const bool laid_out = a.ranges_.size() == chunks.size() && a.buffer_offsets_[0] == 0;
  for (const Chunk& chunk : chunks) a.content_.push_back(chunk.fingerprint);  // (before anything the destructor reads)
  for (size_t r = 0; r < a.ranges_.size() && r < chunks.size(); ++r) {
    a.ranges_[r].shared_fd = chunks[r].fd;
    a.ranges_[r].claim_fd = chunks[r].claim;
    a.ranges_[r].pending = chunks[r].pending;
    a.ranges_[r].own = chunks[r].own;
  }
  if (!laid_out || size % static_cast<size_t>(sysconf(_SC_PAGESIZE)) != 0) {
    for (size_t r = a.ranges_.size(); r < chunks.size(); ++r) {
      if (chunks[r].fd >= 0) store.release_shared(chunks[r].fd);
      if (chunks[r].claim >= 0) store.unclaim_chunk(chunks[r].fingerprint, chunks[r].claim);
    }
    // (A size that is no whole number of pages, say: the pause copies it as before.)
    return Status::Error(Code::kUnsupported, "a content arena's chunks do not match its size");
  }
  // Bytes of chunks the store has, or another process makes: the store's, not this process's.
  size_t held = 0;
  a.pieces_.clear();
  for (size_t r = 0; r < a.ranges_.size(); ++r) {
    Range& range = a.ranges_[r];
    range.pieces_left = range.pending ? 1 : 0;  // a pending chunk is ready once it is settled
    if (range.shared_fd >= 0 || range.pending) {
      range.counted = true;
      held += range.size;
      if (range.shared_fd >= 0) a.shared_ranges_++;
      continue;
    }
    for (size_t at = 0; at < range.size; at += kPieceBytes) {
      a.pieces_.push_back(Piece{r, range.start + at, std::min(kPieceBytes, range.size - at)});
      ++range.pieces_left;
    }
  }
  a.shared_bytes_ = held;
  Status s = a.used_ > held ? budget.reserve(a.used_ - held) : Status::Ok();  // (none needed: none asked)
  if (!s.ok()) return s;
  a.reserved_ = true;
  a.note_use();
  // The address range first, then each chunk's file over its part of it.
  void* p = mmap(nullptr, a.size_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return errno_status("reserving " + format_bytes(a.size_) + " of addresses for backups", errno);
  a.data_ = static_cast<char*>(p);
  for (Range& range : a.ranges_) {
    if (range.pending) continue;
    if (range.shared_fd < 0) {
      s = store.new_chunk(range.size, &range.new_fd);
      if (!s.ok()) return s;
    }
    const bool fresh = range.new_fd >= 0;
    range.made_here = fresh;
    if (mmap(a.data_ + range.start, range.size, fresh ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED | MAP_FIXED,
             fresh ? range.new_fd : range.shared_fd, 0) == MAP_FAILED) {
      return errno_status("mapping a backup chunk", errno);
    }
    if (fresh) madvise(a.data_ + range.start, range.size, MADV_HUGEPAGE);  // where /dev/shm allows them
    keep_from_children(a.data_ + range.start, range.size);
  }
  a.start_workers();
  *out = std::move(arena);
  return Status::Ok();
}

void HostArena::publish() {
  if (content_.empty()) return;  // not a content arena: nothing to name
  std::lock_guard<std::mutex> lock(mu_);
  filled_ = true;
  size_t given_back = 0;  // (to the node's ledger once, not once per chunk)
  for (size_t r = 0; r < ranges_.size(); ++r) {
    Range& range = ranges_[r];
    range.copy_queued = false;  // (its copy has landed: the caller waited for it)
    bool published = false;
    // (Not while a lease lets a user write it: it stays this process's own until then.)
    if (range.new_fd >= 0 && !range.own && live_leases_.load() == 0 &&
        store_->publish_chunk(range.new_fd, content_[r], &published).ok() &&
        published) {
      // Other processes read it from now on: never written here again (no copy goes into a
      // chunk of the store). Its mapping stays writable all the same: changing the protection
      // of page-locked memory costs 65 ms per 8 GiB (H200), a recycled chunk would change it
      // back, and only this process maps it so (the others' mappings are read-only).

      range.shared_fd = range.new_fd;
      range.new_fd = -1;
      range.counted = true;
      shared_ranges_++;
      shared_bytes_ += range.size;
      if (reserved_) given_back += range.size;
    }
    // Named, or the store had it first: whoever waits for it finds it now.
    if (range.claim_fd >= 0) store_->unclaim_chunk(content_[r], range.claim_fd);
    range.claim_fd = -1;
  }
  if (given_back != 0) budget_.give_back(given_back);
}

void HostArena::drop_claims() {
  if (content_.empty()) return;  // not a content arena: no claims
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t r = 0; r < ranges_.size(); ++r) {
    if (ranges_[r].claim_fd >= 0) store_->unclaim_chunk(content_[r], ranges_[r].claim_fd);
    ranges_[r].claim_fd = -1;
  }
}

std::vector<size_t> HostArena::pending_chunks() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<size_t> pending;
  for (size_t r = 0; r < ranges_.size(); ++r) {
    if (ranges_[r].pending) pending.push_back(r);
  }
  return pending;
}

namespace {

bool same_file(int a, int b) {
  struct stat first {}, second {};
  return fstat(a, &first) == 0 && fstat(b, &second) == 0 && first.st_ino == second.st_ino &&
         first.st_dev == second.st_dev;
}

}  // namespace

Status HostArena::replace_retired(Range& range, int fd) {
  // (A recycled arena's ranges are all done: no registrar runs.)
  if (range.registered && !backend_->unregister_host(device_, data_ + range.start).ok()) {
    if (fd >= 0) store_->release_shared(fd);
    return Status::Error(Code::kHostError, "a changed shared backup chunk stayed page-locked");
  }
  range.registered = false;  // page-locked again at its first copy (for_each_part)
  if (fd >= 0) {
    if (mmap(data_ + range.start, range.size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      const int error = errno;
      store_->release_shared(fd);
      return errno_status("mapping a shared backup chunk", error);
    }
    keep_from_children(data_ + range.start, range.size);
  }
  store_->release_shared(range.shared_fd);  // the old file, unmapped now (or mapped over next)
  std::lock_guard<std::mutex> lock(mu_);
  range.shared_fd = fd;
  range.retired = false;
  range.made_here = false;
  if (fd < 0) shared_ranges_--;
  return Status::Ok();
}

// (A pending range is this thread's alone until it is settled: the registrar waits for it.)
Status HostArena::settle_chunk(size_t index, int fd) {
  Range& range = ranges_[index];
  if (range.retired) {
    if (same_file(fd, range.shared_fd)) {
      // Rewritten in place by its maker: its mapping and page-locking here already hold the
      // new bytes.
      store_->adopt_chunk(range.shared_fd, fd);
    } else {
      Status s = replace_retired(range, fd);
      if (!s.ok()) return s;
    }
    std::lock_guard<std::mutex> lock(mu_);
    range.shared_fd = fd;
    range.retired = false;
    range.pending = false;
    changed_.notify_all();
    return Status::Ok();
  }
  if (mmap(data_ + range.start, range.size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    const int error = errno;
    store_->release_shared(fd);
    return errno_status("mapping a shared backup chunk", error);
  }
  keep_from_children(data_ + range.start, range.size);
  std::lock_guard<std::mutex> lock(mu_);
  range.shared_fd = fd;
  range.pending = false;
  range.pieces_left = 0;  // counted as the store's since the arena was made
  shared_ranges_++;
  changed_.notify_all();
  return Status::Ok();
}

Status HostArena::make_chunk(size_t index, int claim) {
  Range& range = ranges_[index];
  {
    std::lock_guard<std::mutex> lock(mu_);
    range.claim_fd = claim;  // let go with the arena should anything below fail
  }
  if (range.retired) {
    // Its maker never came for the new bytes: its old file goes, a new one is made below.
    Status s = replace_retired(range, -1);
    if (!s.ok()) return s;
  }
  Status s = budget_.reserve(range.size);
  if (!s.ok()) return s;
  int fd = -1;
  bool in_file = store_->new_chunk(range.size, &fd).ok() &&
                 mmap(data_ + range.start, range.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) != MAP_FAILED;
  if (in_file) {
    madvise(data_ + range.start, range.size, MADV_HUGEPAGE);
    in_file = fault_in_pages(data_ + range.start, range.size, fd, 0, store_);
  }
  if (!in_file) {
    // No file, or no room for its pages (a full /dev/shm): private memory, never published.
    if (fd >= 0) store_->discard_chunk(fd);
    fd = -1;
    if (!private_memory_at(data_ + range.start, range.size)) {
      budget_.give_back(range.size);
      return Status::Error(Code::kOutOfMemory, "no host memory for a " + format_bytes(range.size) + " backup chunk");
    }
  }
  keep_from_children(data_ + range.start, range.size);
  std::lock_guard<std::mutex> lock(mu_);
  range.new_fd = fd;
  range.made_here = fd >= 0;
  range.own = fd < 0;
  range.pending = false;
  range.counted = false;  // this process's own from here until it is published
  shared_bytes_ -= range.size;
  range.pieces_left = 0;
  changed_.notify_all();
  return Status::Ok();
}

bool HostArena::take_back(Range& range, bool reserved) {
  if (!range.made_here) return false;  // (only its maker has it open for writing)
  // Its bytes go from the store's count (gone with its name) to this process's: reserved
  // first, so that they are never counted by neither.
  const bool reserve = range.counted && reserved_ && !reserved;
  if (reserve && !budget_.reserve(range.size).ok()) return false;
  bool taken = false;
  if (!store_->take_back_chunk(range.shared_fd, &taken).ok() || !taken) {
    if (reserve) budget_.give_back(range.size);
    return false;
  }
  range.new_fd = range.shared_fd;
  range.shared_fd = -1;
  shared_ranges_--;
  if (range.counted) shared_bytes_ -= range.size;
  range.counted = false;
  return true;
}

bool HostArena::recycle(const std::vector<Fingerprint>& content, std::chrono::steady_clock::time_point others_by) {
  std::unique_lock<std::mutex> lock(mu_);
  if (soft_ || content.size() != content_.size() || content.size() != ranges_.size()) return false;
  // A leased arena's bytes are no longer known (a user may have written them): every chunk
  // is copied again, as with a private copy.
  std::vector<size_t> changed;
  for (size_t r = 0; r < ranges_.size(); ++r) {
    if (content[r] == content_[r] && !leased_) continue;
    const Range& range = ranges_[r];
    if (range.pending || range.claim_fd >= 0 || range.size != content[r].bytes) return false;
    // New bytes the store has already are taken from it, not copied again (the caller's way).
    int fd = -1;
    bool here = false;
    if (!store_->open_chunk(content[r], &fd, &here).ok()) return false;
    if (fd >= 0) {
      store_->release_shared(fd);
      return false;
    }
    changed.push_back(r);
  }
  // The bytes of the chunks this process made, which it may take back: from the store's count
  // to this process's, taken from the budget at once (one look at the node's ledger, not one
  // per chunk and per look below); what is not taken back is given back on the way out.
  size_t unused = 0;
  for (size_t r : changed) {
    const Range& range = ranges_[r];
    if (range.shared_fd >= 0 && range.made_here && range.counted && reserved_) unused += range.size;
  }
  if (unused != 0 && !budget_.reserve(unused).ok()) return false;
  struct GiveBackUnused {
    HostBudget& budget;
    size_t& bytes;
    ~GiveBackUnused() {
      if (bytes != 0) budget.give_back(bytes);
    }
  } give_back_unused{budget_, unused};
  auto taken_back = [&](Range& range) {
    const bool counted = range.counted && reserved_;
    if (!take_back(range, counted)) return false;
    if (counted) unused -= range.size;
    return true;
  };
  // Each changed chunk of the store taken back: unnamed, this process's own again. Those
  // other processes hold too (or made) are left for below.
  std::vector<size_t> held_by_others;
  for (size_t r : changed) {
    Range& range = ranges_[r];
    if (range.shared_fd < 0) continue;  // its own already (unnamed, or private memory)
    if (!taken_back(range)) held_by_others.push_back(r);
  }
  // Given up: the ones taken back keep their old bytes (still what content_ says), never
  // published, and the caller lets the arena go (with any retired below: their bytes are
  // nobody's any more).
  std::vector<std::pair<size_t, int>> claimed;  // chunks made here, waited for: (range, claim)
  auto give_up = [&] {
    for (const auto& [r, claim] : claimed) store_->unclaim_chunk(content[r], claim);
    for (size_t t : changed) {
      Range& range = ranges_[t];
      if (range.claim_fd >= 0) store_->unclaim_chunk(content[t], range.claim_fd);  // (taken back below)
      range.claim_fd = -1;
      if (range.shared_fd < 0) range.own = true;
    }
    return false;
  };
  // Never a leased arena's in place (its pages may be a user's), nor one page-locked as one.
  if (!held_by_others.empty() && (leased_ || whole_registered_)) return give_up();
  // Replicas: each chunk made here waits, claimed (the others wait for its new bytes instead
  // of making them), until the others let go of it; each of the others' is retired at once,
  // its maker writing the new bytes into it (no process waits for another before letting go
  // of what it does not make, so no two wait for each other).
  for (size_t r : held_by_others) {
    Range& range = ranges_[r];
    int claim = -1;
    if (range.made_here && !store_->claim_chunk(content[r], &claim).ok()) return give_up();
    if (claim >= 0) {
      claimed.emplace_back(r, claim);
      // Named by another process since the look above (see BackupTiers::taken_if_named_meanwhile):
      // the caller takes it from the store.
      int fd = -1;
      bool here = false;
      if (!store_->open_chunk(content[r], &fd, &here).ok()) return give_up();
      if (fd >= 0) {
        store_->release_shared(fd);
        return give_up();
      }
      continue;
    }
    // (Made here, but another process makes the new bytes: waited for as the others' are.)
    store_->retire_chunk(range.shared_fd);
    range.retired = true;
    range.pending = true;
  }
  // In order, one at a time: the others let go of all their old chunks at once, so the first
  // still held says when to look again (each look is a few system calls).
  for (size_t next = 0; next < claimed.size();) {
    Range& range = ranges_[claimed[next].first];
    if (taken_back(range)) {
      range.claim_fd = claimed[next].second;  // let go once publish() names the new bytes
      ++next;
      continue;
    }
    if (std::chrono::steady_clock::now() >= others_by) {
      // (The claims of those taken back are their ranges' now: give_up lets them go there.)
      claimed.erase(claimed.begin(), claimed.begin() + static_cast<std::ptrdiff_t>(next));
      return give_up();
    }
    lock.unlock();  // (nobody else uses a kept arena meanwhile: a pause holds its allocation)
    usleep(200);
    lock.lock();
  }
  for (size_t r : changed) content_[r] = content[r];  // (their mappings are writable: its own files')
  filled_ = false;  // the pause copies into the changed chunks, then publishes them
  makers_expected_until_ = others_by;
  // Known again once copied, unless a lease still lets a user write them.
  leased_ = live_leases_.load() != 0;
  return true;
}

std::vector<size_t> HostArena::take_in_place(size_t first, const std::vector<Fingerprint>& content, bool* all) {
  std::lock_guard<std::mutex> lock(mu_);
  *all = false;
  std::vector<size_t> taken;
  if (soft_ || leased_ || content_.size() != ranges_.size() || first + content.size() > ranges_.size()) return taken;
  // The changed chunks, up to the first that needs recycle()'s way.
  std::vector<size_t> changed;
  bool every = true;
  for (size_t i = 0; i < content.size() && every; ++i) {
    const size_t r = first + i;
    if (content[i] == content_[r]) continue;
    const Range& range = ranges_[r];
    every = !range.pending && !range.retired && range.claim_fd < 0 && range.size == content[i].bytes;
    if (every) {
      // New bytes the store has already: taken from it by recycle()'s caller, not copied.
      int fd = -1;
      bool here = false;
      every = store_->open_chunk(content[i], &fd, &here).ok() && fd < 0;
      if (fd >= 0) store_->release_shared(fd);
    }
    if (every) changed.push_back(r);
  }
  // Their bytes from the store's count to this process's: from the budget at once (one look
  // at the node's ledger per piece, as recycle() does for a whole arena).
  size_t unused = 0;
  for (size_t r : changed) {
    const Range& range = ranges_[r];
    if (range.shared_fd >= 0 && range.made_here && range.counted && reserved_) unused += range.size;
  }
  if (unused != 0 && !budget_.reserve(unused).ok()) return taken;
  for (size_t r : changed) {
    Range& range = ranges_[r];
    const bool counted = range.shared_fd >= 0 && range.counted && reserved_;
    // (Its own already where it is not the store's: unnamed, or private memory.)
    if (range.shared_fd >= 0 && !take_back(range, counted)) {
      every = false;  // another process holds it too: recycle()'s way, with the replicas
      break;
    }
    if (counted) unused -= range.size;
    content_[r] = content[r - first];
    range.copy_queued = true;
    taken.push_back(r);
  }
  if (unused != 0) budget_.give_back(unused);
  *all = every;
  return taken;
}

void HostArena::forget(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  content_[index] = Fingerprint{};
  ranges_[index].copy_queued = false;
}

std::chrono::steady_clock::time_point HostArena::maker_expected_until(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_[index].retired ? makers_expected_until_ : std::chrono::steady_clock::time_point{};
}

bool HostArena::intact(size_t offset, size_t size, std::string* cut) {
  if (size == 0 || ranges_.empty()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t first = range_index(offset), last = range_index(offset + size - 1);
  for (size_t r = first; r <= last; ++r) {
    if (!range_intact(r, cut)) return false;
  }
  return true;
}

bool HostArena::range_intact(size_t r, std::string* cut) const {
  // (A chunk's file is made at its range's size and never shortened while it is mapped: new
  // chunks are sized before they are mapped, named ones never written. Nor can it be sealed
  // against others shortening it: only a memfd takes F_SEAL_SHRINK, and a memfd cannot be
  // named in the store's directory, another file system; so the size is looked at instead.)
  const Range& range = ranges_[r];
  const int fd = range.shared_fd >= 0 ? range.shared_fd : range.new_fd;
  struct stat st {};
  if (fd < 0 || (fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(range.size))) return true;
  if (cut != nullptr) {
    // Named as the store names it: its directory (where the file was made), its fingerprint.
    char link[64], path[4096];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, path, sizeof(path) - 1);
    const std::string made_in = n > 0 ? std::string(path, static_cast<size_t>(n)) : std::string();
    const std::string name = r < content_.size() ? content_[r].name() : std::string("(unnamed)");
    *cut = "the node's store lost the bytes of a backup: its chunk " +
           (made_in.rfind('/') != std::string::npos ? made_in.substr(0, made_in.rfind('/') + 1) : std::string()) +
           name + " is cut short, " + std::to_string(st.st_size) + " of its " + std::to_string(range.size) +
           " bytes left (a process of this user truncated it, or a cleaner of /dev/shm), so nothing was read from it";
  }
  return false;
}

std::vector<std::pair<size_t, size_t>> HostArena::writable_parts(size_t offset, size_t size) {
  if (content_.empty()) return {{0, size}};
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<size_t, size_t>> parts;
  if (filled_) return parts;  // taken again as it is: its bytes are the same
  for (const Range& range : ranges_) {
    // (Not the store's: a new chunk, or private memory in place of one.)
    if (range.shared_fd >= 0 || range.pending || range.copy_queued || range.start < offset ||
        range.start + range.size > offset + size) {
      continue;
    }
    parts.emplace_back(range.start - offset, range.size);
  }
  return parts;
}

std::vector<Fingerprint> HostArena::content() {
  std::lock_guard<std::mutex> lock(mu_);
  bool pending = false;
  for (const Range& range : ranges_) pending = pending || range.pending;
  return leased_ || pending ? std::vector<Fingerprint>() : content_;
}

}  // namespace tmsl
