#include "core/saver.h"

#include "core/copy_marks.h"
#include "core/mapping.h"


#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace tmsl {
namespace {

// One line of TMSL_LOG_ALLOCATIONS, written by one call so that threads' lines never mix.
void log_allocation(const char* what, const std::string& tag, size_t size, uintptr_t va, int device,
                    const char* detail) {
  const std::string line = std::string("torch_mem_saver_lite: ") + what + " " + format_bytes(size) + " at " +
                           format_address(va) + " on device " + std::to_string(device) + ", tag '" + tag + "' (" +
                           detail + ")\n";
  fputs(line.c_str(), stderr);
}

const char* backup_name(BackupChoice choice) {
  switch (choice) {
    case BackupChoice::kOff: return "no backup";
    case BackupChoice::kOn: return "host backup";
    case BackupChoice::kOnUncached: return "host backup, mmap";
    case BackupChoice::kDisk: return "disk backup";
    default: return "backup as its tag decides";
  }
}

}  // namespace

Saver::Saver(std::unique_ptr<Backend> backend, const SaverSetup& setup)
    : backend_(std::move(backend)), mappings_(*backend_), catcher_(*backend_, mappings_, kPoisonByte),
      log_allocations_(setup.log_allocations), tiers_(backend_, setup.budget, setup.store, setup.keeps_host_cache) {
  // (Without the kernel's random source, a key of the clock's: it guards against damage, not
  // an adversary, and the store's own key is never this one.)
  if (!FingerprintKey::random(&wake_key_).ok()) {
    wake_key_ = FingerprintKey::from_seed(static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  }
  // The tiers own the cache: the ledger's figure and its requests are theirs (by their address).
  setup.budget.on_pressure(&tiers_, [this] { give_cache_back_on_request(); });
}

Saver::~Saver() {
  tiers_.close();
  tiers_.background().wait_idle();  // no preparation may be walking the table below
  tiers_.budget().forget(&tiers_);  // nor a request of another process
  for (auto& entry : table_) {
    Allocation& a = entry.second;
    uncover_stray(a);
    soft_unmap(a);
    mappings_.discard(a.device, a.va, a.size, a.state == State::kActive ? std::move(a.physical) : Pieces());
  }
  mappings_.retry();
}

Status Saver::allocate(size_t size, int device, const std::string& tag, BackupChoice backup,
                       uintptr_t* va) {
  ForegroundGate::Active active(tiers_.gate());  // background host work gives way
  if (size == 0) return Status::Error(Code::kInvalidArgument, "allocation size must be > 0");
  TagInfo* tag_info = nullptr;
  bool catches_strays = false;  // its tag's, now: a pause may cover it
  {
    std::lock_guard<std::mutex> lock(mu_);
    Status s = admit(tag, backup, &tag_info);
    if (!s.ok()) return s;
    catches_strays = this->catches_strays(*tag_info) && (backup == BackupChoice::kOff || backup == BackupChoice::kAuto);
  }
  // Built only on error: formatting it for every allocation cost more than a map lookup.
  auto where = [&] {
    return "allocating " + format_bytes(size) + " in region '" + tag + "' on device " + std::to_string(device);
  };
  size_t granularity = 0;
  Status s = backend_->granularity(device, &granularity);
  if (!s.ok()) return with_context(s, where());
  if (size > SIZE_MAX - granularity) {
    return Status::Error(Code::kInvalidArgument, where() + ": size too large");
  }
  const size_t rounded = (size + granularity - 1) / granularity * granularity;

  // An out-of-memory error, reserving or mapping, carries the figures the user needs.
  auto explain = [&](Status failed) {
    if (failed.code == Code::kOutOfMemory) {
      size_t free_bytes = 0, total = 0;
      backend_->memory_info(device, &free_bytes, &total);
      failed.set_oom({tag, rounded, free_bytes, device});
      // The one place the free figure is told (the causes' own texts leave it out).
      failed.set_message(failed.message() + "; " + format_bytes(free_bytes) + " free");
    }
    return with_context(failed, where());
  };
  // Made before anything is reserved or mapped, so that nothing below allocates host
  // memory outside the guarded recording step (its one handle is held inline).
  Allocation fresh;
  fresh.tag = tag;
  fresh.tag_info = tag_info;
  fresh.choice = backup;
  uintptr_t address = 0;
  s = backend_->reserve(device, rounded, granularity, &address);
  if (!s.ok()) return explain(s);
  PhysicalHandle physical = 0;
  Orphan orphan;
  s = map_physical(*backend_, device, address, rounded, static_cast<size_t>(options_.get(Option::kMemoryMarginBytes)), &physical, &orphan);
  if (!s.ok()) {
    orphan.range = true;  // the range goes back too, once nothing is mapped in it
    if (orphan.physical != 0) mappings_.adopt(orphan);
    else mappings_.discard(device, address, rounded, Pieces());
    return explain(s);
  }

  fresh.va = address;
  fresh.size = rounded;
  fresh.requested = size;
  fresh.device = device;
  fresh.physical.piece_bytes = rounded;
  fresh.physical.handles.push_back(physical);
  // Recording it can run out of host memory: then it is given up whole, not left half known.
  bool refused = false;
  Status recorded = status_of([&] {
    index_.insert(address);
    return Status::Ok();
  });
  if (recorded.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    recorded = status_of([&] {
      // A pause of the tag may have begun since admit(): it would not cover this one.
      refused = tag_info->paused;
      if (refused) return Status::Ok();
      if (!table_.try_emplace(address, std::move(fresh)).second) {
        throw std::logic_error("address " + format_address(address) + " recorded twice");
      }
      return Status::Ok();
    });
    if (!recorded.ok() || refused) index_.erase(address);
  }
  if (refused || !recorded.ok()) {
    mappings_.discard(device, address, rounded, std::move(fresh.physical));
    return refused ? tag_paused_error(tag) : with_context(recorded, where());
  }
  // (Where it fails, even for want of host memory, the pause tries again.)
  if (catches_strays) status_of([&] { return catcher_.prepare(device, rounded); });
  *va = address;
  if (log_allocations_) log_allocation("allocated", tag, rounded, address, device, backup_name(backup));
  return Status::Ok();
}

Status Saver::free(uintptr_t va, void* stream) {
  ForegroundGate::Active active(tiers_.gate());
  Table::node_type node;  // the allocation, out of the table: this call's alone
  HostBuffer host_copy;
  DiskCopies::Copy disk_copy;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      auto it = table_.find(va);
      if (it == table_.end()) {
        return Status::Error(Code::kInvalidArgument,
                             "free of " + format_address(va) +
                                 ": not an allocation of torch_mem_saver_lite (freed twice, or "
                                 "made by another allocator)");
      }
      State state = it->second.state;
      if ((state == State::kActive && !it->second.ahead.sharing) || state == State::kPaused) {
        node = table_.extract(it);
        index_.erase(va);
        // Its copies too, before its address is released and may be another allocation's.
        host_copy = tiers_.copies().take(va);
        disk_copy = tiers_.disk_copies().take(va);  // its file is removed once this call ends
        break;
      }
      settled_.wait(lock);  // a pause or resume (or share_ahead) is working on it
    }
  }
  Allocation& a = node.mapped();
  if (log_allocations_) log_allocation("freeing", a.tag, a.size, a.va, a.device, a.state == State::kPaused ? "paused" : "resident");
  Status first;
  auto keep_first = [&first](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  if (a.state == State::kActive) {
    // Work queued on the stream may still use the memory; other streams are the caller's
    // business (torch waits for their events before it frees a block).
    keep_first(backend_->synchronize_stream(a.device, stream));
  }
  if (a.stray.covered) {
    // Writes into the scratch are counted before it leaves this range (this tag's too), one
    // check at a time with pauses and resumes.
    std::lock_guard<std::mutex> op(op_mu_);
    note_stray_writes({a.device}, &a);
  }
  keep_first(uncover_stray(a));
  keep_first(soft_unmap(a));  // (before its copy, which the caller lets go below, can go)
  keep_first(mappings_.discard(a.device, a.va, a.size, a.state == State::kActive ? std::move(a.physical) : Pieces()));
  if (host_copy) {
    // Its host memory may be the last of an arena: unpinned and unmapped in the background.
    std::vector<HostBuffer> let_go;
    let_go.push_back(std::move(host_copy));
    tiers_.background().release(std::move(let_go));
  }
  mappings_.retry();
  if (first.ok()) return first;
  return with_context(first, "freeing " + format_address(va) + " (tag '" + a.tag + "')");
}

std::vector<Allocation*> Saver::claim(const TagSelection& selection, State from,
                                             State to) {
  std::vector<Allocation*> batch;
  std::vector<uintptr_t> vas;  // for the tiers: made room for first, so nothing below allocates
  batch.reserve(table_.size());
  vas.reserve(table_.size());
  auto take = [&](Allocation& a) {
    if (a.state != from) return;
    a.state = to;
    // No directory now: a mark left on resident memory by an earlier one is void (a paused
    // allocation's mark says its content is in a file, and stays until it is resident).
    if (!disk_ && from == State::kActive) a.disk.marked = false;
    a.backup = a.backs_up();
    a.wake.verify = WakeChecks::checked_for(*a.tag_info);
    // A resume (and its rollback) keeps to the mode its pause covered the memory by.
    a.stray.catches = from == State::kPaused && a.tag_info->paused_stray_mode >= 0
                           ? a.tag_info->paused_stray_mode != static_cast<int>(StrayMode::kOff)
                           : catches_strays(*a.tag_info);
    a.soft.pauses = soft_pauses(*a.tag_info);
    batch.push_back(&a);
    vas.push_back(a.va);
  };
  for_each_selected(selection, take);
  if (!vas.empty()) tiers_.copies().note_state(vas, CopyState::kMoving);  // this operation's: not cache meanwhile
  return batch;
}

void Saver::settle(const std::vector<Allocation*>& batch, size_t done, State done_state,
                   State rest_state, std::vector<HostBuffer>* backups, bool drop_backups) {
  std::vector<HostBuffer> let_go;
  std::vector<std::shared_ptr<DiskFile>> files_let_go;  // removed off the lock
  // Copies of "mmap" allocations: their host memory is given back before the resume
  // returns, as that backend promises (the process's RSS falls at once).
  std::vector<HostBuffer> free_now;
  // Room first: nothing below may fail once states change (a copy replaced and a backup not
  // taken for each allocation at most).
  let_go.reserve(2 * batch.size());
  files_let_go.reserve(batch.size());
  free_now.reserve(batch.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uintptr_t> vas;
    std::vector<int> devices;
    std::vector<HostCopies::Resumed> resumed_batch;
    if (backups != nullptr) {
      vas.reserve(batch.size());
      devices.reserve(batch.size());
    } else {
      resumed_batch.reserve(batch.size());
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      Allocation& a = *batch[i];
      a.state = i < done ? done_state : rest_state;
      // Resident again (a resume, or a pause that let it stay): its file is done with, and
      // after a resume its copy goes to host memory again from the next pause.
      if (a.state == State::kActive) {
        if (DiskCopies::Copy file = tiers_.disk_copies().take(a.va)) files_let_go.push_back(std::move(file.file));
      }
      if (a.state == State::kActive && backups == nullptr) a.disk.marked = false;
      if (backups != nullptr) {
        vas.push_back(a.va);
        devices.push_back(a.device);
      } else {
        resumed_batch.push_back(resumed(a));
      }
    }
    // The copies (the tiers'): what a pause made, or which a resume (resident when done,
    // paused otherwise) keeps.
    if (backups != nullptr) {
      tiers_.copies().settle_pause(vas, devices, done, backups, &let_go);
    } else {
      // (A cache of no bytes keeps nothing after a resume, the store's chunks neither.)
      tiers_.copies().settle_resume(resumed_batch, done, drop_backups, options_.flag(Option::kRetainCpuBackup), tiers_.cache_bytes() > 0,
                                    &let_go, &free_now);
    }
  }
  settled_.notify_all();  // first: nothing below may keep a waiting free asleep
  tiers_.background().release(std::move(let_go));
  HostPool::FreeNow now(tiers_.pool());
  free_now.clear();
  files_let_go.clear();
}

Status Saver::pause(const TagSelection& selection) {
  Status s;
  {
    ForegroundOp op(*this);
    const auto started = std::chrono::steady_clock::now();
    std::set<std::string> moved;
    s = pause_locked(selection, &moved);
    if (s.code == Code::kOutOfMemory && disk_) {
      // What the others' caches did not free in time goes to disk too.
      s = pause_locked(selection, &moved, true);
    }
    if (s.code == Code::kOutOfMemory) s = with_disk_hint(s);
    if (s.ok()) note_duration(moved, started, &TagInfo::last_pause_seconds);
    tiers_.publish_cache();
  }
  return s;
}

Status Saver::resume(const TagSelection& selection) {
  Status s;
  std::set<std::string> moved;
  {
    ForegroundOp op(*this);
    const auto started = std::chrono::steady_clock::now();
    s = resume_locked(selection, &moved);
    if (s.ok()) note_duration(moved, started, &TagInfo::last_resume_seconds);
    tiers_.publish_cache();
  }
  return s;
}

void Saver::note_duration(const std::set<std::string>& tags, std::chrono::steady_clock::time_point started,
                          double TagInfo::*field) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& tag : tags) {
    auto it = tags_.find(tag);
    if (it != tags_.end()) it->second.*field = seconds;
  }
}

Status Saver::pause_locked(const TagSelection& selection, std::set<std::string>* moved, bool spill_everything) {
  mappings_.retry();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Status s = check_known(selection);
    if (s.ok()) s = check_disk_directory(selection);
    if (!s.ok()) return s;
  }
  // What the budget cannot hold goes to disk (off the table lock: it asks the node's budget).
  if (disk_) choose_spill(selection, spill_everything);
  std::vector<Allocation*> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : tags_) {  // the mode this pause covers them by (a paused tag keeps its own)
      if (selection.matches(entry.first) && !entry.second.paused) {
        entry.second.paused_stray_mode = static_cast<int>(stray_mode_of(entry.second));
      }
    }
    set_paused(selection, true);  // from here on new allocations in these tags are refused
    batch = claim(selection, State::kActive, State::kPausing);
  }
  note_tags(batch, moved);
  if (batch.empty()) return Status::Ok();
  // Allocations without a backup first: they are released while the others' copies run.
  std::stable_partition(batch.begin(), batch.end(), [](const Allocation* a) { return !a->backup; });
  std::vector<HostBuffer> backups(batch.size());
  CopyMarks copies(*backend_, batch.size(), devices_of(batch));
  size_t done = 0;
  bool releasing = false;  // batch[done] has begun to be released: it can no longer stay resident
  // Whatever happens in here (an exception too), the batch is settled below.
  Status s = status_of([&] {
    // Kernels still queued may read or write these pages.
    Status r = synchronize_devices(batch);
    if (!r.ok()) {
      return with_context(r, "pausing " + describe(batch) + ": everything stays resident with its content, "
                             "call pause again");
    }
    ready_stray_catchers(batch);  // before any copy: it may fill a scratch
    // The disk files are written first, and every copy queued, before anything is released,
    // so a failure to write or queue one (no host memory, say) leaves everything resident.
    r = write_disk_backups(batch);
    if (!r.ok()) return r;
    // Then each allocation goes as soon as its own copies have landed: releasing overlaps the copies of the ones after it.
    r = queue_backups(&batch, &backups, &copies);
    bool fingerprinted = false;
    while (r.ok() && done < batch.size()) {
      // Beside the copies, once those without a copy (first in the batch) are released.
      if (batch[done]->copied()) r = take_wake_fingerprints(batch, &fingerprinted);
      if (!r.ok()) break;
      soft_swap(*batch[done], backups[done]);  // (after the fingerprints, which read its address)
      r = copies.wait(done);
      if (!r.ok()) {
        return with_context(r, "pausing " + describe(batch) + ": copying backups to the host failed; " +
                                   (done == 0 ? std::string("everything stays resident with its content")
                                              : "what was copied is paused with its backup, the rest stays "
                                                "resident with its content") +
                                   ", call pause again");
      }
      releasing = false;
      // Its new chunks of the node's store hold their bytes now: named, others may take them.
      r = finish_content(batch, backups, &copies, done);
      if (r.ok()) r = release_physical(*batch[done], &releasing, backups[done]);
      if (r.ok() || releasing) {
        ++done;
        releasing = false;
      }
    }
    return r;
  });
  if (releasing) ++done;  // an exception escaped midway: what is left of it went to orphans
  copies.finish();  // also after an error: copies in flight still write into the host memory
  for (size_t i = done; i < batch.size(); ++i) soft_unswap(*batch[i]);  // (after an error) resident as before
  if (!s.ok()) {
    // Chunks this pause claimed and did not name: the processes waiting for them go on at once.
    for (size_t i = done; i < backups.size(); ++i) {
      if (backups[i]) backups[i].arena->drop_claims();  // (a content arena's: any other has none)
    }
  }
  if (!s.ok() && done == 0) backups.assign(batch.size(), HostBuffer());  // nothing released: none kept
  settle(batch, done, State::kPaused, State::kActive, &backups, false);
  if (!s.ok()) {
    // A tag stays paused only where some of its memory was released.
    std::lock_guard<std::mutex> lock(mu_);
    std::set<std::string> released;
    for (const auto& entry : table_) {
      if (entry.second.state == State::kPaused) released.insert(entry.second.tag);
    }
    for (auto& entry : tags_) {
      if (selection.matches(entry.first)) entry.second.paused = released.count(entry.first) != 0;
    }
  }
  return s;
}

Status Saver::queue_backups(std::vector<Allocation*>* batch_in, std::vector<HostBuffer>* backups,
                            CopyMarks* copies) {
  std::vector<Allocation*>& batch = *batch_in;
  // Where each copy goes: the host memory it kept from its last cycle, else the tiers' (the
  // node's store for large copies where it shares, the pool, fresh memory). "mmap" copies get
  // memory of their own: it goes back at resume.
  std::vector<CopyRequest> requests(batch.size());
  std::vector<HostBuffer> kept;  // the copies the tiers hold for the batch (moving: this pause's)
  kept = tiers_.copies().peek(addresses_of(batch));
  // The store takes a large copy where another process of the node could share it, and one
  // whose copy is in the store already (alone now or not: its unchanged chunks cost nothing).
  const FingerprintKey* key = tiers_.content_key();
  const bool store_now = key != nullptr && tiers_.store_key_now() != nullptr;
  const auto others_by = std::chrono::steady_clock::now() + tiers_.patience_for_replicas();
  size_t bytes = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Allocation& a = *batch[i];
    HostBuffer& copy = kept[i];
    CopyRequest& r = requests[i];
    a.wake.fingerprints.clear();  // this pause's, below or in take_wake_fingerprints
    a.wake.unchecked = false;
    a.soft.copy_at = 0;
    r.device = a.device;
    r.bytes = a.backup_bytes();
    r.cacheable = a.choice != BackupChoice::kOnUncached;
    const bool soft = soft_request(a, copy);
    const bool reusable = copy && copy.size == r.bytes && !copy.arena->is_content() && !soft;
    r.tier = !a.backup ? Tier::kNone : reusable ? Tier::kKept : Tier::kHost;
    r.soft_span = soft ? a.size : 0;
    const bool stored = copy && copy.arena->is_content();
    if (a.backup && !a.soft.pauses && content_addressed(a, key) && (store_now || stored)) {
      // (A private copy it kept goes at settle: the store's chunks replace it.)
      Status s = content_copy(a, *key, &copy, &(*backups)[i], &a.wake.fingerprints, others_by, true, copies);
      if (!s.ok() && s.code != Code::kUnsupported) return s;
      if (s.ok()) r.tier = Tier::kContent;
      const bool verify = wake_.on(a);
      if (s.ok() && verify) a.wake.key = key;
      if (!s.ok() || !verify) a.wake.fingerprints.clear();
    }
    if (r.tier == Tier::kKept) {
      (*backups)[i] = copy;  // retained or cached from the last cycle: reused
      copy.arena->note_use();
    } else if (r.tier == Tier::kHost) {
      bytes += r.bytes;
    }
  }
  kept.clear();
  {
    // Page-locked memory already there before fresh memory: the pool's, then stale cached
    // copies of any tag and shape, whose arenas come back to the pool (let go here) to be carved.
    std::vector<HostBuffer> stale = tiers_.take_stale_cache(requests);
  }
  // Over the node's budget (or out of host memory): the pool and the caches give way.
  Status s = tiers_.with_room(bytes, [&] { return tiers_.host_memory(requests, true, backups); });
  if (!s.ok()) {
    return with_context(s, "pausing " + describe(batch) + ": no host memory for " + format_bytes(bytes) +
                               " of backups; everything stays resident with its content, call pause "
                               "again once host memory is free");
  }
  // Copies waiting for chunks other processes are making go last: everything this pause makes
  // itself is named before it waits for theirs (so no two pauses wait for each other).
  order_pending_last(&batch, backups);
  for (size_t i = 0; i < batch.size(); ++i) {
    Allocation& a = *batch[i];
    const HostBuffer& backup = (*backups)[i];
    if (!backup) continue;
    soft_alias(a, backup);
    const uintptr_t source = a.soft.alias != 0 ? a.soft.alias : a.va;
    copies->begin();
    // Into the whole copy, or into a content arena's new chunks only.
    for (const auto& [from, n] : backup.arena->writable_parts(backup.offset, backup.size)) {
      s = backup.for_each_part(from, n, [&](char* host, size_t at, size_t part) {
        return backup.arena->copy_in(a.device, host, source + at, part);
      });
      if (!s.ok()) break;
    }
    if (s.ok()) s = copies->mark(i, a.device);
    if (!s.ok()) {
      return with_context(s, "pausing " + describe(batch) + ": copying backups to the host failed; everything "
                                 "stays resident with its content, call pause again");
    }
  }
  return Status::Ok();
}

Status Saver::release_physical(Allocation& a, bool* unmapped, const HostBuffer& copy) {
  Status s = a.soft.alias != 0 ? soft_release(a, unmapped) : mappings_.take_down(a.device, a.va, a.size, a.physical, unmapped);
  if (s.ok()) soft_map(a, copy);
  if (s.ok()) cover_stray(a);
  if (s.ok()) return s;
  const std::string where = "pausing tag '" + a.tag + "' (" + format_bytes(a.size) + " at " +
                            format_address(a.va) + " on device " + std::to_string(a.device) + ")";
  return with_context(s, *unmapped ? where : where + "; it stays resident with its content");
}

Status Saver::resume_locked(const TagSelection& selection, std::set<std::string>* moved) {
  mappings_.retry();
  std::vector<Allocation*> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Status s = check_known(selection);
    if (!s.ok()) return s;
    batch = claim(selection, State::kPaused, State::kResuming);
    note_tags(batch, moved);
    if (batch.empty()) {
      set_paused(selection, false);
      return Status::Ok();
    }
  }
  status_of([&] {  // before the scratch leaves the batch (a failure: not counted)
    note_stray_writes(devices_of(batch));
    return Status::Ok();
  });
  std::vector<HostBuffer> copies;  // the batch's host copies, the tiers'
  size_t done = 0;
  WakeCheckBehind behind;
  // Whatever happens in here (an exception too), what was mapped is rolled back below.
  Status s = status_of([&] {
    copies = tiers_.copies().peek(addresses_of(batch));  // once no range of them is being shared
    // Each piece's copy is queued as soon as it is mapped, so mapping the next piece
    // overlaps it.
    Status r;
    while (r.ok() && done < batch.size()) {
      Allocation& a = *batch[done];
      if (a.physical.empty() && mappings_.mapped_in(a.device, a.va, a.size)) {
        // Mapping over it would be refused by the driver, or (host backend) later undone
        // by the orphan's own unmap.
        r = Status::Error(Code::kDriverError, "memory at " + format_address(a.va) + " (tag '" + a.tag +
                                                  "') that an earlier unmap failed on is still mapped");
      }
      if (r.ok() && a.physical.empty()) r = plan_pieces(a, static_cast<bool>(copies[done]));
      if (r.ok()) r = map_next_piece(a);
      if (r.ok()) r = restore(a, copies[done], a.physical.handles.size() - 1);
      if (r.ok() && copies[done]) r = check_wake_behind(a, a.physical.offset(a.physical.handles.size()), &behind);
      if (r.ok() && a.physical.handles.size() == a.physical.count(a.size)) ++done;
    }
    if (r.ok()) r = read_disk_backups(batch, copies);  // everything is mapped now
    Status waited = wake_.drop_mark(&behind);
    if (waited.ok()) waited = wait_copies(batch);
    if (r.ok() && waited.ok()) r = check_wake(batch);
    return r.ok() ? with_context(waited, "restoring backups") : r;
  });
  if (!s.ok()) {
    // Whatever happens in here too, the batch is settled below: a free waiting on it wakes.
    s = status_of([&] {
      wake_.drop_mark(&behind);  // (the copies are waited for next)
      wait_copies(batch);  // the memory must not be unmapped under a running copy
      for (size_t i = 0; i < batch.size() && i <= done; ++i) {  // batch[done]: the pieces mapped so far
        mappings_.take_down(batch[i]->device, batch[i]->va, batch[i]->size, batch[i]->physical);
        soft_map(*batch[i], i < copies.size() ? copies[i] : HostBuffer());  // paused again: as it was
        cover_stray(*batch[i]);
      }
      if (s.code == Code::kOutOfMemory && done < batch.size()) return out_of_memory_on_resume(batch, *batch[done], s);
      if (s.code == Code::kContentMismatch) return s;  // it says what stays paused
      return with_context(s, "resuming " + describe(batch) + " failed; everything it covered stays paused with "
                                 "its backups kept, call resume again");
    });
    copies.clear();
    settle(batch, 0, State::kActive, State::kPaused, nullptr, false);
    return s;
  }
  note_wake_checks(batch);
  {
    std::lock_guard<std::mutex> lock(mu_);
    set_paused(selection, false);
  }
  // Only the tiers hold the copies from here: one a resume lets go of ("mmap") is freed in it.
  copies.clear();
  bool keep = false;
  std::vector<HostBuffer> older;  // cached copies that give way to this batch's newer ones
  {
    std::vector<HostCopies::Resumed> resumed_batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Allocation* a : batch) resumed_batch.push_back(resumed(*a));
    }
    keep = tiers_.keep_after_resume(resumed_batch, options_.flag(Option::kRetainCpuBackup), &older);
  }
  older.clear();  // back to the pool within its limit, else freed after the foreground's work
  settle(batch, batch.size(), State::kActive, State::kPaused, nullptr, !keep);
  return Status::Ok();
}

// ----- the wake check's stages (WakeChecks) ------------------------------------------------

Status Saver::take_wake_fingerprints(const std::vector<Allocation*>& batch, bool* taken) {
  if (*taken) return Status::Ok();
  *taken = true;
  // One key per process (the store's where it shares): the device keeps the last one it had.
  return wake_.fingerprint_pause(batch, process_key());
}

Status Saver::check_wake_chunks(Allocation& a, size_t end, const CopyMark* after) {
  std::vector<std::pair<size_t, Fingerprint>> differing;
  Status s = wake_.compare(a, end, after, &differing);
  if (!s.ok()) return s;
  for (const auto& [k, restored] : differing) {
    if (soft_write_kept(a, k, restored)) {
      WakeChecks::accept(a, k, restored);  // written while soft-paused: the write is the content
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      a.tag_info->last_wake_check = WakeCheck::kFailed;
    }
    return WakeChecks::mismatch(a, k);
  }
  WakeChecks::checked_up_to(a, end);
  return Status::Ok();
}

Status Saver::check_wake_behind(Allocation& a, size_t restored, WakeCheckBehind* behind) {
  if (behind->marked) {
    // The chunks wholly restored by the pieces before this one (all of them, at the end).
    Allocation& earlier = *behind->a;
    const size_t chunks = earlier.wake.fingerprints.size();
    const size_t end = behind->restored >= earlier.backup_bytes() ? chunks : behind->restored / HostArena::kRangeBytes;
    Status s = check_wake_chunks(earlier, end, &behind->mark);
    const Status waited = wake_.drop_mark(behind);  // its copies have landed: a failure there is theirs
    if (!s.ok()) return s;
    if (!waited.ok()) return with_context(waited, "restoring backups");
  }
  return wake_.mark_behind(a, restored, behind);
}

Status Saver::check_wake(const std::vector<Allocation*>& batch) {
  for (Allocation* a : batch) {
    if (!wake_.checks(*a)) continue;
    Status s = check_wake_chunks(*a, a->wake.fingerprints.size(), nullptr);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

void Saver::note_wake_checks(const std::vector<Allocation*>& batch) {
  const std::map<TagInfo*, WakeCheck> verdicts = wake_.verdicts(batch);
  for (Allocation* a : batch) a->soft.copy_at = 0;  // (the check's second look is done)
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [info, verdict] : verdicts) {
    if (verdict != WakeCheck::kNever) info->last_wake_check = verdict;
  }
}

}  // namespace tmsl
