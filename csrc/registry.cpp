#include "registry.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace tmsl {
namespace {

constexpr size_t kMaxSavers = 64;

struct Registry {
  std::mutex mu;  // serializes changes; readers use the atomics
  std::array<std::atomic<Saver*>, kMaxSavers> savers{};
  std::atomic<Saver*> process_wide{nullptr};
};

// Never destroyed: the allocation hooks may run during static destruction.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

bool parse_flag(const char* name, bool* out, std::string* error) {
  const char* value = getenv(name);
  if (value == nullptr || *value == '\0') return true;
  if (strcmp(value, "1") == 0 || strcmp(value, "true") == 0) {
    *out = true;
  } else if (strcmp(value, "0") == 0 || strcmp(value, "false") == 0) {
    *out = false;
  } else {
    *error += std::string(error->empty() ? "" : "; ") + name + " must be 0 or 1, got '" + value + "'";
    return false;
  }
  return true;
}

ProcessDefaults read_process_defaults() {
  ProcessDefaults d;
  bool ok = parse_flag("TMSL_REGION_ALL_THREADS", &d.all_threads, &d.error);
  bool backup = false;
  const char* backup_value = getenv("TMSL_DEFAULT_CPU_BACKUP");
  if (parse_flag("TMSL_DEFAULT_CPU_BACKUP", &backup, &d.error)) {
    if (backup_value != nullptr && *backup_value != '\0') d.backup = backup ? BackupChoice::kOn : BackupChoice::kOff;
  } else {
    ok = false;
  }
  ok = parse_flag("TMSL_POISON_ON_RESUME", &d.poison_on_resume, &d.error) && ok;
  const char* tag = getenv("TMSL_DEFAULT_TAG");
  if (tag != nullptr) {
    size_t length = strlen(tag);
    if (length == 0 || length > 256) {
      d.error += std::string(d.error.empty() ? "" : "; ") +
                 "TMSL_DEFAULT_TAG must be 1 to 256 characters";
      ok = false;
    } else {
      d.tag = tag;
    }
  }
  if (!ok) d.all_threads = false;
  return d;
}

// Puts a saver in a free slot, where owner_of finds it. Needs the registry's lock.
Status publish(Registry& r, Saver* saver) {
  for (auto& slot : r.savers) {
    if (slot.load() == nullptr) {
      slot.store(saver, std::memory_order_release);
      return Status::Ok();
    }
  }
  return Status::Error(Code::kInvalidArgument, "too many savers (at most 64 at once)");
}

}  // namespace

ThreadRegion& thread_region() {
  static thread_local ThreadRegion region;
  return region;
}

const ProcessDefaults& process_defaults() {
  static const ProcessDefaults* defaults = new ProcessDefaults(read_process_defaults());
  return *defaults;
}

const ThreadRegion& effective_region() {
  const ThreadRegion& region = thread_region();
  if (region.saver != nullptr || region.explicit_none) return region;
  // The process defaults as this thread's region, filled in once the saver exists.
  static thread_local ThreadRegion from_defaults;
  const ProcessDefaults& d = process_defaults();
  if (from_defaults.saver == nullptr && d.all_threads && default_saver(&from_defaults.saver).ok()) {
    from_defaults.tag = d.tag;
    from_defaults.backup = d.backup;
  }
  return from_defaults;
}

Status default_saver(Saver** out) {
  Registry& r = registry();
  if (Saver* existing = r.process_wide.load(std::memory_order_acquire)) {
    *out = existing;
    return Status::Ok();
  }
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.process_wide.load() == nullptr) {
    std::unique_ptr<Backend> backend;
    Status s = make_cuda_backend(&backend);
    if (!s.ok()) return s;
    auto saver = std::make_unique<Saver>(std::move(backend));
    saver->set_poison_on_resume(process_defaults().poison_on_resume);
    // Unpublished, the hooks could not find its allocations to free them.
    s = publish(r, saver.get());
    if (!s.ok()) return s;
    r.process_wide.store(saver.release(), std::memory_order_release);
  }
  *out = r.process_wide.load();
  return Status::Ok();
}

Status add_saver(std::unique_ptr<Saver> saver, Saver** out) {
  saver->set_poison_on_resume(process_defaults().poison_on_resume);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  Status s = publish(r, saver.get());
  if (s.ok()) *out = saver.release();
  return s;
}

Status remove_saver(Saver* saver) {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (saver != nullptr && saver == r.process_wide.load()) {
      return Status::Error(Code::kInvalidArgument, "the process-wide saver cannot be destroyed");
    }
    bool found = false;
    for (auto& slot : r.savers) {
      if (saver != nullptr && slot.load() == saver) {
        slot.store(nullptr, std::memory_order_release);
        found = true;
      }
    }
    if (!found) return Status::Error(Code::kInvalidArgument, "unknown saver handle");
  }
  ThreadRegion& region = thread_region();
  if (region.saver == saver) region = ThreadRegion();
  delete saver;
  return Status::Ok();
}

bool is_live(const Saver* saver) {
  if (saver == nullptr) return false;
  for (const auto& slot : registry().savers) {
    if (slot.load(std::memory_order_acquire) == saver) return true;
  }
  return false;
}

Saver* owner_of(uintptr_t va) {
  for (const auto& slot : registry().savers) {
    Saver* saver = slot.load(std::memory_order_acquire);
    if (saver != nullptr && saver->owns(va)) return saver;
  }
  return nullptr;
}

}  // namespace tmsl
