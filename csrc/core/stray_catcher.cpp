#include "core/stray_catcher.h"

#include <algorithm>

namespace tmsl {
namespace {

// The fingerprint of `bytes` bytes all `fill`: every full segment has the same value, so the
// CPU computes one segment (and a short last one) instead of the whole rung.
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
  for (auto& ladder : ladders_) {
    for (auto& entry : ladder.second.rungs) {
      Rung& r = entry.second;
      // (What cannot be unmapped is leaked rather than given back under a mapping.)
      if (!backend_.unmap(ladder.first, r.va, r.size).ok()) continue;
      backend_.release_scratch(ladder.first, r.handle, r.size);
      backend_.free_reservation(ladder.first, r.va, r.size);
    }
  }
}

std::vector<size_t> StrayCatcher::rungs_for(const Ladder& ladder, size_t size) {
  std::vector<size_t> sizes;
  if (size >= ladder.largest) sizes.push_back(ladder.largest);
  size_t rest = size % ladder.largest;
  for (size_t rung = ladder.largest / 2; rest > 0 && rung >= ladder.granularity; rung /= 2) {
    if (rest >= rung) {
      sizes.push_back(rung);
      rest -= rung;
    }
  }
  return sizes;
}

Status StrayCatcher::ladder(int device, Ladder** out) {
  auto it = ladders_.find(device);
  if (it == ladders_.end()) {
    Ladder made;
    Status s = backend_.granularity(device, &made.granularity);
    if (!s.ok()) return s;
    // The largest: the backend's size, to a power-of-two multiple of the granularity.
    made.largest = made.granularity;
    while (made.largest * 2 <= backend_.stray_scratch_bytes(device)) made.largest *= 2;
    it = ladders_.emplace(device, made).first;
  }
  *out = &it->second;
  return Status::Ok();
}

Status StrayCatcher::make_rung(int device, size_t size, Rung* out) {
  Rung rung;
  rung.size = size;
  Status s = backend_.create_scratch(device, size, &rung.handle);
  if (!s.ok()) return s;
  size_t granularity = 0;
  s = backend_.granularity(device, &granularity);
  if (s.ok()) s = backend_.reserve(device, size, granularity, &rung.va);
  if (s.ok()) {
    s = backend_.map(device, rung.va, size, rung.handle);
    bool mapped = s.ok();
    if (s.ok()) {
      s = backend_.set_access(device, rung.va, size);
      if (!s.ok()) mapped = !backend_.unmap(device, rung.va, size).ok();
    }
    if (mapped && !s.ok()) return s;  // still mapped: leaked rather than given back under it
    if (!s.ok()) backend_.free_reservation(device, rung.va, size);
  }
  if (!s.ok()) {
    backend_.release_scratch(device, rung.handle, size);
    return s;
  }
  *out = rung;
  return Status::Ok();
}

Status StrayCatcher::prepare(int device, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  Ladder* rungs = nullptr;
  Status s = ladder(device, &rungs);
  for (size_t rung : s.ok() ? rungs_for(*rungs, size) : std::vector<size_t>()) {
    if (rungs->rungs.count(rung) != 0) continue;
    Rung made;
    s = make_rung(device, rung, &made);
    if (!s.ok()) return s;
    rungs->rungs.emplace(rung, made);
  }
  return s;
}

Status StrayCatcher::fill(int device, Rung* rung) {
  rung->filled = false;
  Status s = backend_.fill_async(device, rung->va, rung->size, fill_);
  if (s.ok()) s = backend_.wait_copies(device);
  rung->filled = s.ok();
  return s;
}

Status StrayCatcher::ready_to_cover(int device, size_t size) {
  Status s = prepare(device, size);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : ladders_[device].rungs) {
    if (!entry.second.filled) s = fill(device, &entry.second);
    if (!s.ok()) return s;
  }
  return s;
}

Status StrayCatcher::cover(int device, uintptr_t va, size_t size) {
  std::vector<std::pair<PhysicalHandle, size_t>> steps;  // the rungs, in address order
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto ladder = ladders_.find(device);
    if (ladder == ladders_.end()) return Status::Error(Code::kUnsupported, "no scratch on device " + std::to_string(device));
    for (size_t rung : rungs_for(ladder->second, size)) {
      auto it = ladder->second.rungs.find(rung);
      if (it == ladder->second.rungs.end() || !it->second.filled) {
        return Status::Error(Code::kUnsupported, "no scratch of " + format_bytes(rung) + " ready on device " +
                                                     std::to_string(device));
      }
      const size_t times = rung == ladder->second.largest ? size / rung : 1;
      for (size_t k = 0; k < times; ++k) steps.emplace_back(it->second.handle, rung);
    }
  }
  size_t mapped = 0;
  Status s;
  for (const auto& [handle, bytes] : steps) {
    s = backend_.map(device, va + mapped, bytes, handle);
    if (!s.ok()) break;
    mapped += bytes;
  }
  // One access change for the whole range (the driver takes it across the mappings).
  if (s.ok()) s = backend_.set_access(device, va, size);
  if (!s.ok() && mapped > 0) uncover(device, va, mapped);
  return s;
}

size_t StrayCatcher::bytes(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  auto ladder = ladders_.find(device);
  if (ladder != ladders_.end()) {
    for (const auto& entry : ladder->second.rungs) total += entry.first;
  }
  return total;
}

Status StrayCatcher::uncover(int device, uintptr_t va, size_t size) {
  Status s = backend_.unmap(device, va, size);
  if (!s.ok()) mappings_.adopt({device, va, size, 0, true, false});
  return s;
}

Status StrayCatcher::check(int device, const FingerprintKey& key, bool* written) {
  *written = false;
  std::lock_guard<std::mutex> lock(mu_);
  auto ladder = ladders_.find(device);
  if (ladder == ladders_.end()) return Status::Ok();
  Status first;
  for (auto& entry : ladder->second.rungs) {
    Rung& rung = entry.second;
    if (!rung.filled) continue;  // nothing covered with it yet
    if (rung.key != &key) {
      rung.expected = fill_fingerprint(rung.size, fill_, key);
      rung.key = &key;
    }
    std::vector<uint64_t> values(fingerprint_segments_in(rung.size) * kFingerprintLanes);
    Status s = backend_.fingerprint(device, rung.va, rung.size, key, values.data());
    if (s.ok() && !(join_segments(values.data(), rung.size, key) == rung.expected)) {
      *written = true;
      s = fill(device, &rung);
    }
    if (!s.ok() && first.ok()) first = s;  // the other rungs are checked all the same
  }
  return first;
}

}  // namespace tmsl
