#include "registry.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace tmsl {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<Saver*> savers;
  Saver* process_wide = nullptr;
};

// Never destroyed: the allocation hooks may run during static destruction.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

ThreadRegion& thread_region() {
  static thread_local ThreadRegion region;
  return region;
}

Status default_saver(Saver** out) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.process_wide == nullptr) {
    std::unique_ptr<Backend> backend;
    Status s = make_cuda_backend(&backend);
    if (!s.ok()) return s;
    r.process_wide = new Saver(std::move(backend));
    r.savers.push_back(r.process_wide);
  }
  *out = r.process_wide;
  return Status::Ok();
}

Saver* add_saver(std::unique_ptr<Saver> saver) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.savers.push_back(saver.get());
  return saver.release();
}

Status remove_saver(Saver* saver) {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (saver == r.process_wide) {
      return Status::Error(Code::kInvalidArgument, "the process-wide saver cannot be destroyed");
    }
    auto it = std::find(r.savers.begin(), r.savers.end(), saver);
    if (it == r.savers.end()) return Status::Error(Code::kInvalidArgument, "unknown saver handle");
    r.savers.erase(it);
  }
  ThreadRegion& region = thread_region();
  if (region.saver == saver) region = ThreadRegion();
  delete saver;
  return Status::Ok();
}

bool is_live(const Saver* saver) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return std::find(r.savers.begin(), r.savers.end(), saver) != r.savers.end();
}

Saver* owner_of(uintptr_t va) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (Saver* saver : r.savers) {
    if (saver->owns(va)) return saver;
  }
  return nullptr;
}

}  // namespace tmsl
