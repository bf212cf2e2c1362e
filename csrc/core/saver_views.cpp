// What the saver tells about what it holds: the figures per tag and device, the bytes the
// spill sent to disk, and the backups it leases out (get_cpu_backup; the copies are the
// tiers', HostCopies).
#include "core/saver.h"

#include <algorithm>
#include <iterator>
#include <map>

namespace tmsl {

std::vector<TagFigures> Saver::figures() const {
  std::map<std::pair<std::string, int>, TagFigures> per;  // (tag, device)
  std::lock_guard<std::mutex> lock(mu_);
  // The tiers' copies, by address as the table: walked beside it.
  const std::vector<std::pair<uintptr_t, size_t>> copies = tiers_.copies().sizes();
  const std::vector<uintptr_t> in_store = tiers_.copies().in_store();
  auto copy = copies.begin();
  auto stored = in_store.begin();
  for (const auto& entry : table_) {
    const Allocation& a = entry.second;
    while (copy != copies.end() && copy->first < a.va) ++copy;
    const size_t copy_bytes = copy != copies.end() && copy->first == a.va ? copy->second : 0;
    TagFigures& f = per[{a.tag, a.device}];
    f.allocations += 1;
    f.reserved += a.size;
    f.backs_up = f.backs_up || a.backs_up();
    // An allocation mid-pause still holds its memory; one mid-resume does not yet.
    bool resident = a.state == State::kActive || a.state == State::kPausing;
    (resident ? f.resident : f.paused_bytes) += a.size;
    if (a.state != State::kPausing) f.host_backup += copy_bytes;  // retained copies count too
    if (a.state == State::kPaused) f.disk_backup += tiers_.disk_copies().bytes(a.va);
    while (stored != in_store.end() && *stored < a.va) ++stored;
    if (!resident) {
      const bool on_disk = tiers_.disk_copies().has(a.va), shared = stored != in_store.end() && *stored == a.va;
      (on_disk ? f.paused_on_disk : copy_bytes == 0 ? f.paused_discarded : shared ? f.paused_in_store : f.paused_in_host) += a.size;
    }
  }
  std::vector<TagFigures> out;
  out.reserve(per.size() + tags_.size());
  auto next = per.begin();
  for (const auto& entry : tags_) {  // both in tag order
    const bool has_allocations = next != per.end() && next->first.first == entry.first;
    if (!has_allocations) {
      TagFigures none;
      none.tag = entry.first;
      none.info = entry.second;
      out.push_back(std::move(none));
    }
    for (; next != per.end() && next->first.first == entry.first; ++next) {
      TagFigures f = next->second;
      f.tag = entry.first;
      f.device = next->first.second;
      f.info = entry.second;
      out.push_back(std::move(f));
    }
  }
  for (TagFigures& f : out) f.backs_up = f.backs_up || f.info.backs_up();
  return out;
}

size_t Saver::spilled_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (const auto& entry : table_) {
    if (entry.second.disk.marked && entry.second.state == State::kPaused) bytes += entry.second.size;
  }
  return bytes;
}

const Allocation* Saver::containing(uintptr_t address) const {
  auto it = table_.upper_bound(address);
  if (it == table_.begin()) return nullptr;
  --it;
  const Allocation& a = it->second;
  return address < a.va + a.size ? &a : nullptr;
}

bool Saver::paused_tag_in(uintptr_t address, size_t nbytes, std::string* tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  // The allocation holding `address`, then those starting inside the range.
  auto it = table_.upper_bound(address);
  if (it != table_.begin() && std::prev(it)->second.va + std::prev(it)->second.size > address) --it;
  for (; it != table_.end() && it->first < address + std::max<size_t>(nbytes, 1); ++it) {
    if (it->second.state != State::kActive) {
      *tag = it->second.tag;
      return true;
    }
  }
  return false;
}

Status Saver::lease_backup(uintptr_t address, size_t nbytes, const void** host, HostBuffer* lease) {
  // Not while a pause or resume copies: making a backup one registration re-registers it.
  ForegroundOp op(*this);
  HostBuffer backup;
  uintptr_t start = 0;
  bool paused = false, backs_up = false;
  std::string tag;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Allocation* a = containing(address);
    if (a == nullptr || nbytes > a->va + a->size - address) {
      return Status::Error(Code::kInvalidArgument,
                           "memory at " + format_address(address) +
                               " was not allocated inside a region (or has been freed)");
    }
    if (a->disk.marked && a->state == State::kPaused) {
      return Status::Error(Code::kInvalidArgument,
                           "the backup of tag '" + a->tag + "' at " + format_address(a->va) +
                               " is in a disk file, not host memory: the node's host-memory budget could not "
                               "hold it at its pause (saver.host_memory()); read it once resumed");
    }
    paused = a->state == State::kPaused;
    backs_up = a->backs_up();
    tag = a->tag;
    start = a->va;
  }
  // The copy is the tiers': off mu_, as they may wait for a range of it being shared. Resident,
  // a copy kept by the cache is stale; one kept by retention is handed out (HostCopies::lease).
  bool has_copy = false;
  backup = tiers_.copies().lease(start, paused, &has_copy);
  if (!backs_up && !has_copy) {
    return Status::Error(Code::kInvalidArgument,
                         "tag '" + tag + "' keeps no CPU backup: enter its region with enable_cpu_backup=True");
  }
  *host = nullptr;
  *lease = HostBuffer();
  if (!backup) return Status::Ok();
  if (address - start > backup.size || nbytes > backup.size - (address - start)) {
    return Status::Error(Code::kInvalidArgument,
                         format_bytes(nbytes) + " at " + format_address(address) + " run past the " +
                             format_bytes(backup.size) + " backed up of the allocation at " + format_address(start) +
                             " (a backup holds the bytes that were asked for, not the rest of the last granule)");
  }
  // Users copy from it with torch in one piece, which must not cross registrations. Off mu_:
  // re-registering gigabytes must not stall allocations and frees; op_mu_ keeps the backup
  // paused, and the copy of the buffer keeps its memory alive even if it is freed meanwhile.
  Status s = backup.arena->register_as_one(backup.offset, backup.size);
  if (!s.ok()) return with_context(s, "page-locking the backup at " + format_address(start) + " as one range");
  *host = backup.data() + (address - start);
  *lease = std::move(backup);
  return Status::Ok();
}

}  // namespace tmsl
