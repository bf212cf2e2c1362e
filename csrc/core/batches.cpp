// What the saver says of a batch of allocations a pause or resume works on: its devices,
// its tags, how a message names it (and a resume short of device memory), what the tiers
// need of it at a resume, and the waits on its devices.
#include "core/saver.h"

namespace tmsl {

// Batches hold runs of one device and one tag: a set is asked only when the value changes.
std::set<int> Saver::devices_of(const std::vector<Allocation*>& batch) {
  std::set<int> devices;
  int last = -1;
  for (const Allocation* a : batch) {
    if (a->device != last) devices.insert(last = a->device);
  }
  return devices;
}

std::vector<uintptr_t> Saver::addresses_of(const std::vector<Allocation*>& batch) {
  std::vector<uintptr_t> addresses;
  addresses.reserve(batch.size());
  for (const Allocation* a : batch) addresses.push_back(a->va);
  return addresses;
}

void Saver::note_tags(const std::vector<Allocation*>& batch, std::set<std::string>* tags) {
  const std::string* last = nullptr;
  for (const Allocation* a : batch) {
    if (last == nullptr || *last != a->tag) tags->insert(*(last = &a->tag));
  }
}

std::string Saver::describe(const std::vector<Allocation*>& batch) {
  std::set<std::string> tags;
  size_t bytes = 0;
  for (const Allocation* a : batch) {
    tags.insert("'" + a->tag + "'");
    bytes += a->size;
  }
  std::string names;
  for (const std::string& tag : tags) names += (names.empty() ? "" : ", ") + tag;
  return "tag" + std::string(tags.size() > 1 ? "s " : " ") + names + " (" + format_bytes(bytes) + ")";
}

HostCopies::Resumed Saver::resumed(const Allocation& a) {
  HostCopies::Resumed r;
  r.va = a.va;
  r.cacheable = a.choice != BackupChoice::kOnUncached &&
                a.tag_info->options.value_or(Option::kCachesBackups, option_default(Option::kCachesBackups)) != 0;
  r.uncached = a.choice == BackupChoice::kOnUncached;
  return r;
}

Status Saver::out_of_memory_on_resume(const std::vector<Allocation*>& batch,
                                      const Allocation& failed, const Status& cause) {
  size_t needed = 0;
  for (const Allocation* a : batch) {
    if (a->device == failed.device) needed += a->size;
  }
  size_t free_bytes = 0, total = 0;
  backend_->memory_info(failed.device, &free_bytes, &total);
  Status s = Status::Error(
      Code::kOutOfMemory,
      "cannot resume tag '" + failed.tag + "' on device " + std::to_string(failed.device) +
          ": this resume needs " + format_bytes(needed) + " there and " + format_bytes(free_bytes) +
          " is free (" + cause.message() + "). Everything it covered stays paused" +
          " with its backups kept; free memory and call resume again.");
  s.set_oom({failed.tag, needed, free_bytes, failed.device});
  return s;
}

Status Saver::synchronize_devices(const std::vector<Allocation*>& batch) {
  for (int device : devices_of(batch)) {
    Status s = backend_->synchronize_device(device);
    if (!s.ok()) return with_context(s, "waiting for device " + std::to_string(device));
  }
  return Status::Ok();
}

Status Saver::wait_copies(const std::vector<Allocation*>& batch) {
  Status first;
  for (int device : devices_of(batch)) {
    Status s = backend_->wait_copies(device);
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

}  // namespace tmsl
