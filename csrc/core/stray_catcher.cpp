#include "core/stray_catcher.h"

#include <algorithm>
#include <vector>

namespace tmsl {
namespace {

// The fingerprint of `bytes` bytes all `fill`: every full segment has the same value, so the
// CPU computes one segment (and a short last one) instead of the whole scratch.
Fingerprint fill_fingerprint(size_t bytes, unsigned char fill, const FingerprintKey& key) {
  std::vector<char> segment(std::min(bytes, kFingerprintSegmentBytes), static_cast<char>(fill));
  uint64_t full[kFingerprintLanes];
  fingerprint_segments(segment.data(), segment.size(), key, full);
  const size_t count = fingerprint_segments_in(bytes);
  std::vector<uint64_t> values(count * kFingerprintLanes);
  for (size_t k = 0; k < count; ++k) {
    const size_t length = std::min(kFingerprintSegmentBytes, bytes - k * kFingerprintSegmentBytes);
    if (length == segment.size()) std::copy(full, full + kFingerprintLanes, &values[k * kFingerprintLanes]);
    else fingerprint_segments(segment.data(), length, key, &values[k * kFingerprintLanes]);
  }
  return join_segments(values.data(), bytes, key);
}

}  // namespace

StrayCatcher::~StrayCatcher() {
  for (auto& entry : scratches_) {
    Scratch& s = entry.second;
    if (backend_.unmap(entry.first, s.va, s.size).ok()) backend_.release_scratch(entry.first, s.handle, s.size);
    backend_.free_reservation(entry.first, s.va, s.size);
  }
}

bool StrayCatcher::ready(int device) const {
  if (device >= 0 && device < 64) return (ready_low_.load(std::memory_order_acquire) >> device) & 1;
  std::lock_guard<std::mutex> lock(mu_);
  return scratches_.count(device) != 0;
}

StrayCatcher::Scratch* StrayCatcher::find(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = scratches_.find(device);
  return it == scratches_.end() ? nullptr : &it->second;
}

Status StrayCatcher::prepare(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  if (scratches_.count(device) != 0) return Status::Ok();
  size_t granularity = 0;
  Status s = backend_.granularity(device, &granularity);
  if (!s.ok()) return s;
  Scratch scratch;
  scratch.size = (backend_.stray_scratch_bytes(device) + granularity - 1) / granularity * granularity;
  s = backend_.create_scratch(device, scratch.size, &scratch.handle);
  if (!s.ok()) return s;
  s = backend_.reserve(device, scratch.size, granularity, &scratch.va);
  if (s.ok()) {
    s = backend_.map(device, scratch.va, scratch.size, scratch.handle);
    if (s.ok()) {
      s = backend_.set_access(device, scratch.va, scratch.size);
      if (!s.ok()) backend_.unmap(device, scratch.va, scratch.size);
    }
    if (!s.ok()) backend_.free_reservation(device, scratch.va, scratch.size);
  }
  if (!s.ok()) {
    backend_.release_scratch(device, scratch.handle, scratch.size);
    return s;
  }
  scratches_.emplace(device, scratch);
  if (device >= 0 && device < 64) ready_low_.fetch_or(uint64_t{1} << device, std::memory_order_release);
  return Status::Ok();
}

Status StrayCatcher::fill(int device, Scratch* scratch) {
  scratch->filled = false;
  Status s = backend_.fill_async(device, scratch->va, scratch->size, fill_);
  if (s.ok()) s = backend_.wait_copies(device);
  scratch->filled = s.ok();
  return s;
}

Status StrayCatcher::ready_to_cover(int device) {
  Status s = prepare(device);
  Scratch* scratch = find(device);
  if (s.ok() && !scratch->filled) s = fill(device, scratch);
  return s;
}

Status StrayCatcher::cover(int device, uintptr_t va, size_t size) {
  Scratch* scratch = find(device);
  if (scratch == nullptr || !scratch->filled) {
    return Status::Error(Code::kUnsupported, "no scratch ready on device " + std::to_string(device));
  }
  size_t mapped = 0;
  Status s;
  while (s.ok() && mapped < size) {
    const size_t n = std::min(scratch->size, size - mapped);
    s = backend_.map(device, va + mapped, n, scratch->handle);
    if (s.ok()) mapped += n;
  }
  // One access change for the whole range (the driver takes it across the mappings).
  if (s.ok()) s = backend_.set_access(device, va, size);
  if (!s.ok() && mapped > 0) uncover(device, va, mapped);
  return s;
}

Status StrayCatcher::uncover(int device, uintptr_t va, size_t size) {
  Status s = backend_.unmap(device, va, size);
  if (!s.ok()) mappings_.adopt({device, va, size, 0, true, false});
  return s;
}

Status StrayCatcher::check(int device, const FingerprintKey& key, bool* written) {
  *written = false;
  Scratch* scratch = find(device);
  if (scratch == nullptr || !scratch->filled) return Status::Ok();  // nothing covered with it yet
  if (scratch->key != &key) {
    scratch->expected = fill_fingerprint(scratch->size, fill_, key);
    scratch->key = &key;
  }
  std::vector<uint64_t> values(fingerprint_segments_in(scratch->size) * kFingerprintLanes);
  Status s = backend_.fingerprint(device, scratch->va, scratch->size, key, values.data());
  if (!s.ok()) return s;
  if (join_segments(values.data(), scratch->size, key) == scratch->expected) return Status::Ok();
  *written = true;
  return fill(device, scratch);
}

}  // namespace tmsl
