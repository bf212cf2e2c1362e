// The saver's side of the disk tier (tiers/disk_tier.h): which allocations a pause writes to
// files (its own choice, kDisk, or the spill's: the tiers choose which backed-up allocations
// the node's budget cannot hold, BackupTiers::choose_spill, and the saver marks them), and
// reading them back at resume. A file belongs to its allocation while paused: dropped (and so
// removed) by the resume that read it back, a free, or the saver's end.
#include <algorithm>
#include <cstdio>

#include "core/saver.h"
#include "platform/environment.h"

namespace tmsl {

Status Saver::set_disk_directory(const std::string& path) {
  std::shared_ptr<DiskTier> tier;
  if (!path.empty()) {
    Status s = DiskTier::open(backend_, path, &tier);  // its notices wait for disk_notices()
    if (!s.ok()) return s;
  }
  ForegroundOp op(*this);  // not under a pause that is writing files
  std::lock_guard<std::mutex> lock(mu_);
  disk_ = std::move(tier);
  return Status::Ok();
}

std::string Saver::disk_directory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return disk_ ? disk_->directory() : std::string();
}

std::vector<std::string> Saver::disk_notices() {
  std::shared_ptr<DiskTier> tier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tier = disk_;
  }
  return tier ? tier->take_notices() : std::vector<std::string>();
}

size_t Saver::choose_spill(const TagSelection& selection, bool everything) {
  // Under op_mu_: no other pause chooses host memory meanwhile, nor frees what this one
  // reuses. The selection, as the tiers need it: every allocation's address, and whether this
  // pause would copy it to host memory (resident and backed up).
  std::vector<BackupTiers::SpillCandidate> selected;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for_each_selected(selection, [&](Allocation& a) {
      if (a.state == State::kActive) a.disk.marked = false;  // judged afresh
      selected.push_back({a.va, a.backup_bytes(), a.state == State::kActive && a.backs_up()});
    });
  }
  // Off the table lock: the budget takes the node's lock.
  const std::vector<uintptr_t> marked = selected.empty() ? std::vector<uintptr_t>() : tiers_.choose_spill(selected, everything);
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uintptr_t va : marked) {
      // Freed meanwhile (its address perhaps reused): its bytes need no host memory.
      auto it = table_.find(va);
      if (it == table_.end()) continue;
      Allocation& a = it->second;
      if (a.state != State::kActive || a.disk.marked || !a.backs_up()) continue;
      a.disk.marked = true;
      bytes += a.size;
    }
  }
  if (bytes > 0 && disk_) {
    char size[32];
    snprintf(size, sizeof(size), "%.0f MiB", bytes / 1048576.0);
    disk_->note(std::string("the node's host-memory budget cannot hold the backups of this pause: ") + size +
                " of them go to disk backup in " + disk_->directory() + " instead");
  }
  return bytes;
}

Status Saver::no_disk_directory(const std::string& tag) {
  return Status::Error(Code::kInvalidArgument,
                       "tag '" + tag + "' keeps its content on disk while paused (enable_disk_backup) but no disk "
                       "backup directory is set: call set_disk_backup_dir(path) or set TMSL_DISK_BACKUP_DIR "
                       "(TMS_DISK_BACKUP_DIR) to a directory on a real disk first");
}

Status Saver::check_disk_directory(const TagSelection& selection) {
  if (disk_) return Status::Ok();
  Status s;
  for_each_selected(selection, [&](const Allocation& a) {
    if (s.ok() && a.state == State::kActive && a.choice == BackupChoice::kDisk) s = no_disk_directory(a.tag);
  });
  return s;
}

Status Saver::with_disk_hint(const Status& refusal) const {
  // Under op_mu_: disk_ cannot change.
  Status s = refusal;
  s.set_message(refusal.message() +
                (disk_ ? "; the disk tier (" + disk_->directory() + ") could not take the rest: a tag paused in part "
                         "(or whose last resume was undone) keeps host backups, as its files cannot be written now; "
                         "resume it, then pause again"
                       : std::string("; or set a disk backup directory (set_disk_backup_dir or TMSL_DISK_BACKUP_DIR): "
                                     "what the budget cannot hold then goes to disk")));
  return s;
}

Status Saver::write_disk_backups(const std::vector<Allocation*>& batch) {
  // Under op_mu_: disk_ cannot change. The batch is this pause's (kPausing): its fields are ours.
  std::vector<Allocation*> to_disk;
  for (Allocation* a : batch) {
    if (a->effective_choice() == BackupChoice::kDisk && !tiers_.disk_copies().has(a->va)) to_disk.push_back(a);
  }
  if (to_disk.empty()) return Status::Ok();
  // (check_disk_directory refused this earlier; an allocation made since, in another region,
  // must not be released without its file either.)
  if (!disk_) return no_disk_directory(to_disk.front()->tag);
  DiskSettings settings;
  Status s = disk_backup_settings(&settings.chunk_bytes, &settings.workers);
  if (!s.ok()) return s;
  std::vector<DiskRange> ranges;
  for (const Allocation* a : to_disk) ranges.push_back({a->va, a->size, a->device, a->tag});
  std::vector<std::shared_ptr<DiskFile>> files;
  // Staging comes from the budget too: the pool and the caches give way as for host copies.
  s = tiers_.with_room(settings.workers * settings.chunk_bytes,
                       [&] { return disk_->save(ranges, settings, tiers_, &files); });
  if (!s.ok()) return s;  // no file left; nothing released yet
  std::lock_guard<std::mutex> lock(mu_);  // figures() reads them
  for (size_t i = 0; i < to_disk.size(); ++i) {
    const size_t bytes = files[i]->size();
    tiers_.disk_copies().put(to_disk[i]->va, DiskCopies::Copy{std::move(files[i]), disk_, bytes});
  }
  return Status::Ok();
}

Status Saver::read_disk_backups(const std::vector<Allocation*>& batch, const std::vector<HostBuffer>& copies) {
  // One load per tier that wrote files (the directory may have changed since).
  std::map<DiskTier*, std::pair<std::vector<DiskRange>, std::vector<DiskFile*>>> by_tier;
  for (const Allocation* a : batch) {
    // (The copy stays in place: the allocation is this resume's until it settles.)
    const DiskCopies::Copy copy = tiers_.disk_copies().find(a->va);
    if (!copy) continue;
    auto& entry = by_tier[copy.tier.get()];
    entry.first.push_back({a->va, copy.file->size(), a->device, a->tag});
    entry.second.push_back(copy.file.get());
  }
  if (by_tier.empty()) return Status::Ok();
  DiskSettings settings;
  Status s = disk_backup_settings(&settings.chunk_bytes, &settings.workers);
  for (auto it = by_tier.begin(); s.ok() && it != by_tier.end(); ++it) {
    s = it->first->load(it->second.first, it->second.second, settings, tiers_);
    if (s.code == Code::kOutOfMemory) s = load_through_own_copies(batch, copies, *it->first, it->second, settings);
  }
  return s;
}

Status Saver::load_through_own_copies(const std::vector<Allocation*>& batch, const std::vector<HostBuffer>& copies,
                                      DiskTier& tier,
                                      const std::pair<std::vector<DiskRange>, std::vector<DiskFile*>>& files,
                                      const DiskSettings& settings) {
  // No room for staging: the budget holds this resume's own host copies. Their content is
  // restored to the device once the copies queued so far land, so they stage the files (the
  // budget is never exceeded), then get their content back from the device, read or not: a
  // copy kept after the resume, or kept by a resume that fails, holds what it held.
  Status s = wait_copies(batch);
  if (!s.ok()) return with_context(s, "restoring backups");
  std::vector<size_t> lenders;  // indexes in the batch: the largest, one a worker
  for (size_t i = 0; i < batch.size(); ++i) {
    if (copies[i] && !tiers_.disk_copies().has(batch[i]->va) && copies[i].arena->poolable()) lenders.push_back(i);
  }
  std::stable_sort(lenders.begin(), lenders.end(),
                   [&](size_t x, size_t y) { return copies[x].size > copies[y].size; });
  if (lenders.size() > std::max<size_t>(1, settings.workers)) lenders.resize(std::max<size_t>(1, settings.workers));
  std::vector<HostBuffer> lent;
  for (size_t i : lenders) lent.push_back(copies[i]);
  if (lent.empty()) return Status::Error(Code::kOutOfMemory, "no host memory to stage the disk backups through");
  s = tier.load(files.first, files.second, settings, tiers_, &lent);
  std::set<int> devices;
  Status back;
  for (size_t i : lenders) {
    const Allocation* a = batch[i];
    const size_t bytes = std::min(copies[i].size, a->size);
    Status t = copies[i].for_each_part(0, bytes, [&](char* host, size_t at, size_t n) {
      return backend_->copy_to_host_async(a->device, host, a->va + at, n);
    });
    if (back.ok() && !t.ok()) back = t;
    devices.insert(a->device);
  }
  for (int device : devices) {
    CopyMark mark = 0;
    Status t = backend_->mark_copies(device, &mark);
    if (t.ok()) t = backend_->wait_copy_mark(device, mark);
    if (back.ok() && !t.ok()) back = t;
  }
  if (!back.ok()) return with_context(back, "giving the host copies that staged the disk backups their content back");
  return s;
}

}  // namespace tmsl
