// torch_memory_saver's C entry points (c_api.h), for code that binds them by name with
// ctypes: from the preloaded library (ctypes.CDLL(None).tms_pause) or through the drop-in's
// torch_memory_saver._impl._binary_wrapper.cdll. They work on the process-wide saver and
// the calling thread's region; where torch_memory_saver would end the process, they return
// non-zero and keep the error as the thread's last error. They run no Python-side hooks
// (register_hooks); disk-backed memory goes to the process-wide saver's disk tier, whose
// directory comes from TMSL_DISK_BACKUP_DIR / TMS_DISK_BACKUP_DIR (or set_disk_backup_dir).
#include <cstring>

#include "api/abi_guard.h"
#include "api/node_budget.h"
#include "api/c_api.h"
#include "core/thread_region.h"

using namespace tmsl;

namespace {

bool host_backup(BackupChoice choice) {
  return choice == BackupChoice::kOn || choice == BackupChoice::kOnUncached;
}

// The thread's region as torch_memory_saver's per-thread configuration sees it: a copy of
// the effective one, to change and make the thread's own.
ThreadRegion current() {
  ThreadRegion region = effective_region(&saver_setup, process_defaults());
  if (region.tag.empty()) region.tag = process_defaults().tag;
  return region;
}

// pause or resume of one tag (NULL: every tag); a tag no region has used is skipped, as
// torch_memory_saver does.
int on_one_tag(const char* tag, Status (Saver::*operation)(const TagSelection&)) {
  return guarded([&] {
    SaverHandle handle = 0;
    Status s = default_saver(&saver_setup, process_defaults(), &handle);
    SaverRef saver;
    if (s.ok()) s = live_saver(reinterpret_cast<void*>(handle), &saver);
    if (!s.ok()) return s;
    TagSelection selection;
    if (tag != nullptr) {
      TagInfo info;
      if (!saver->tag_info(tag, &info)) return Status::Ok();
      selection.all = false;
      selection.tags.insert(tag);
    }
    return (*saver.*operation)(selection);
  });
}

}  // namespace

TMSL_API int tms_pause(const char* tag) { return on_one_tag(tag, &Saver::pause); }

TMSL_API int tms_resume(const char* tag) { return on_one_tag(tag, &Saver::resume); }

TMSL_API const char* tms_get_current_tag(void) {
  static thread_local std::string tag;
  tag = current().tag;
  return tag.c_str();
}

TMSL_API void tms_set_current_tag(const char* tag) {
  if (tag == nullptr || *tag == '\0') return;
  ThreadRegion region = current();
  region.tag = tag;
  thread_region() = std::move(region);
}

TMSL_API bool tms_get_interesting_region(void) { return effective_region(&saver_setup, process_defaults()).saver != 0; }

TMSL_API void tms_set_interesting_region(bool interesting) {
  ThreadRegion region = current();
  if (interesting == (region.saver != 0)) return;
  if (interesting) {
    if (!default_saver(&saver_setup, process_defaults(), &region.saver).ok()) return;  // no driver: allocations stay ordinary
    region.explicit_none = false;
  } else {
    region.saver = 0;
    region.explicit_none = true;
  }
  thread_region() = std::move(region);
}

TMSL_API bool tms_get_enable_cpu_backup(void) { return host_backup(effective_region(&saver_setup, process_defaults()).backup); }

TMSL_API void tms_set_enable_cpu_backup(bool enable) {
  ThreadRegion region = current();
  if (enable == host_backup(region.backup)) return;
  region.backup = !enable                                  ? BackupChoice::kOff
                  : process_defaults().caches_backups ? BackupChoice::kOn
                                                           : BackupChoice::kOnUncached;
  thread_region() = std::move(region);
}

TMSL_API const char* tms_get_cpu_backup_backend(void) {
  BackupChoice choice = effective_region(&saver_setup, process_defaults()).backup;
  bool caches = host_backup(choice) ? choice == BackupChoice::kOn : process_defaults().caches_backups;
  return caches ? "pinned" : "mmap";
}

TMSL_API void tms_set_cpu_backup_backend(const char* backend) {
  ThreadRegion region = current();
  if (backend == nullptr || !host_backup(region.backup)) return;  // a backend means nothing without backup
  if (strcmp(backend, "mmap") == 0) region.backup = BackupChoice::kOnUncached;
  if (strcmp(backend, "pinned") == 0) region.backup = BackupChoice::kOn;
  thread_region() = std::move(region);
}

TMSL_API bool tms_get_enable_disk_backup(void) { return effective_region(&saver_setup, process_defaults()).backup == BackupChoice::kDisk; }

TMSL_API void tms_set_enable_disk_backup(bool enable) {
  ThreadRegion region = current();
  if (enable == (region.backup == BackupChoice::kDisk)) return;
  region.backup = enable ? BackupChoice::kDisk : BackupChoice::kOff;
  thread_region() = std::move(region);
}

TMSL_API void set_memory_margin_bytes(uint64_t bytes) {
  SaverHandle handle = 0;
  SaverRef saver;
  if (default_saver(&saver_setup, process_defaults(), &handle).ok() && live_saver(reinterpret_cast<void*>(handle), &saver).ok()) {
    saver->set_option(Option::kMemoryMarginBytes, bytes);
  }
}

TMSL_API void tms_set_retain_cpu_backup(bool retain) {
  SaverHandle handle = 0;
  SaverRef saver;
  if (default_saver(&saver_setup, process_defaults(), &handle).ok() && live_saver(reinterpret_cast<void*>(handle), &saver).ok()) {
    saver->set_option(Option::kRetainCpuBackup, retain ? 1 : 0);
  }
}

TMSL_API bool tms_get_retain_cpu_backup(void) {
  SaverHandle handle = 0;
  SaverRef saver;
  if (!default_saver(&saver_setup, process_defaults(), &handle).ok() || !live_saver(reinterpret_cast<void*>(handle), &saver).ok()) return false;
  return saver->option(Option::kRetainCpuBackup) != 0;
}
