// What the saver tells about what it holds: the figures per tag and device, the backups it
// leases out (get_cpu_backup), and what a batch covers (its devices, tags, description).
#include "core/saver.h"

#include <map>

namespace tmsl {

std::vector<TagFigures> Saver::figures() const {
  std::map<std::pair<std::string, int>, TagFigures> per;  // (tag, device)
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& entry : table_) {
    const Allocation& a = entry.second;
    TagFigures& f = per[{a.tag, a.device}];
    f.allocations += 1;
    f.reserved += a.size;
    f.backs_up = f.backs_up || a.backs_up();
    // An allocation mid-pause still holds its memory; one mid-resume does not yet.
    bool resident = a.state == State::kActive || a.state == State::kPausing;
    (resident ? f.resident : f.paused_bytes) += a.size;
    if (a.state != State::kPausing && a.host_copy) f.host_backup += a.host_copy.size;  // retained copies count too
    if (a.state == State::kPaused && a.disk_file) f.disk_backup += a.disk_file->size();
  }
  std::vector<TagFigures> out;
  out.reserve(per.size() + tags_.size());
  auto next = per.begin();
  for (const auto& entry : tags_) {  // both in tag order
    const bool has_allocations = next != per.end() && next->first.first == entry.first;
    if (!has_allocations) out.push_back(TagFigures{entry.first, -1, 0, 0, 0, 0, 0, 0, false, entry.second});
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

const Saver::Allocation* Saver::containing(uintptr_t address) const {
  auto it = table_.upper_bound(address);
  if (it == table_.begin()) return nullptr;
  --it;
  const Allocation& a = it->second;
  return address < a.va + a.size ? &a : nullptr;
}

Status Saver::lease_backup(uintptr_t address, size_t nbytes, const void** host, HostBuffer* lease) {
  // Not while a pause or resume copies: making a backup one registration re-registers it.
  ForegroundOp op(*this);
  HostBuffer backup;
  uintptr_t start = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Allocation* a = containing(address);
    if (a == nullptr || nbytes > a->va + a->size - address) {
      return Status::Error(Code::kInvalidArgument,
                           "memory at " + format_address(address) +
                               " was not allocated inside a region (or has been freed)");
    }
    if (a->disk_marked && a->state == State::kPaused) {
      return Status::Error(Code::kInvalidArgument,
                           "the backup of tag '" + a->tag + "' at " + format_address(a->va) +
                               " is in a disk file, not host memory: the node's host-memory budget could not "
                               "hold it at its pause (saver.host_memory()); read it once resumed");
    }
    if (!a->backs_up() && !a->host_copy) {
      return Status::Error(Code::kInvalidArgument,
                           "tag '" + a->tag +
                               "' keeps no CPU backup: enter its region with enable_cpu_backup=True");
    }
    // Resident, a copy kept by the cache is stale; one kept by retention is handed out, as
    // torch_memory_saver does (its content is that of the last pause).
    if (a->state == State::kPaused || a->retained) backup = a->host_copy;
    start = a->va;
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
