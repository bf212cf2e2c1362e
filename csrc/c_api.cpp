#include "c_api.h"

#include <unistd.h>

#include <cstring>
#include <exception>
#include <new>

#include "registry.h"

using namespace tmsl;

namespace {

// Runs `body`, turning a failed Status or any C++ exception into the thread's last error
// and a status code: nothing escapes into the caller's C frames.
template <typename Body>
int guarded(Body&& body) {
  Status s;
  try {
    s = body();
  } catch (const std::bad_alloc&) {
    s = Status::Error(Code::kOutOfMemory, "out of host memory for bookkeeping");
  } catch (const std::exception& e) {
    s = Status::Error(Code::kHostError, std::string("internal error: ") + e.what());
  } catch (...) {
    s = Status::Error(Code::kHostError, "internal error");
  }
  if (!s.ok()) set_last_error(s);
  return static_cast<int>(s.code);
}

Status live_saver(void* handle, Saver** out) {
  auto* saver = static_cast<Saver*>(handle);
  if (saver == nullptr || !is_live(saver)) {
    return Status::Error(Code::kInvalidArgument, "invalid or destroyed saver handle");
  }
  *out = saver;
  return Status::Ok();
}

// guarded(), for a call on a saver handle that must be live.
template <typename Body>
int on_saver(void* handle, Body&& body) {
  return guarded([&] {
    Saver* saver = nullptr;
    Status s = live_saver(handle, &saver);
    return s.ok() ? body(*saver) : s;
  });
}

Status tag_selection(const char* const* tags, int ntags, TagSelection* out) {
  out->all = ntags < 0;
  for (int i = 0; i < ntags; ++i) {
    if (tags[i] == nullptr) return Status::Error(Code::kInvalidArgument, "tag must not be NULL");
    out->tags.insert(tags[i]);
  }
  return Status::Ok();
}

Status require(bool condition, const char* message) {
  return condition ? Status::Ok() : Status::Error(Code::kInvalidArgument, message);
}

Status backup_choice(int value, BackupChoice* out) {
  if (value < -1 || value > 1) {
    return Status::Error(Code::kInvalidArgument, "enable_cpu_backup must be -1 (not given), 0 or 1");
  }
  *out = static_cast<BackupChoice>(value);
  return Status::Ok();
}

// The thread region for (saver, tag, backup), argument checks included.
Status region_for(void* handle, const char* tag, int enable_cpu_backup, ThreadRegion* out) {
  Status s = live_saver(handle, &out->saver);
  if (s.ok()) s = require(tag != nullptr && *tag != '\0', "tag must be a non-empty string");
  if (s.ok()) s = backup_choice(enable_cpu_backup, &out->backup);
  if (s.ok()) out->tag = tag;
  return s;
}

// pause or resume over the named tags (ntags < 0: all).
int on_tags(void* handle, const char* const* tags, int ntags,
            Status (Saver::*operation)(const TagSelection&)) {
  return on_saver(handle, [&](Saver& saver) {
    TagSelection selection;
    Status s = tag_selection(tags, ntags, &selection);
    return s.ok() ? (saver.*operation)(selection) : s;
  });
}

}  // namespace

TMSL_API int tmsl_default_saver(void** out) {
  return guarded([&] {
    Saver* saver = nullptr;
    Status s = default_saver(&saver);
    *out = saver;
    return s;
  });
}

TMSL_API int tmsl_create_host_saver(size_t capacity_bytes, size_t granularity_bytes, void** out) {
  return guarded([&] {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    Status s = require(granularity_bytes > 0 && granularity_bytes % page == 0,
                       "host granularity must be a positive multiple of the page size");
    if (!s.ok()) return s;
    Saver* saver = nullptr;
    s = add_saver(std::make_unique<Saver>(make_host_backend(capacity_bytes, granularity_bytes)), &saver);
    *out = saver;
    return s;
  });
}

TMSL_API int tmsl_destroy_saver(void* handle) {
  return guarded([&] { return remove_saver(static_cast<Saver*>(handle)); });
}

TMSL_API int tmsl_enter_region(void* handle, const char* tag, int enable_cpu_backup) {
  return guarded([&] {
    ThreadRegion region;
    Status s = region_for(handle, tag, enable_cpu_backup, &region);
    if (s.ok()) s = region.saver->enter_tag(region.tag, region.backup);
    if (s.ok()) thread_region() = std::move(region);
    return s;
  });
}

TMSL_API int tmsl_set_thread_region(void* handle, const char* tag, int enable_cpu_backup) {
  return guarded([&] {
    ThreadRegion region;  // saver == NULL: back to the process defaults
    Status s = handle == nullptr ? Status::Ok() : region_for(handle, tag, enable_cpu_backup, &region);
    if (s.ok()) thread_region() = std::move(region);
    return s;
  });
}

TMSL_API int tmsl_disable_thread_region(void) {
  ThreadRegion& region = thread_region();
  region = ThreadRegion();
  region.explicit_none = true;
  return 0;
}

TMSL_API int tmsl_set_memory_margin(void* handle, size_t bytes) {
  return on_saver(handle, [&](Saver& saver) {
    saver.set_memory_margin(bytes);
    return Status::Ok();
  });
}

TMSL_API int tmsl_set_retain_backups(void* handle, int retain) {
  return on_saver(handle, [&](Saver& saver) {
    saver.set_retain_backups(retain != 0);
    return Status::Ok();
  });
}

TMSL_API int tmsl_set_poison_on_resume(void* handle, int poison) {
  return on_saver(handle, [&](Saver& saver) {
    saver.set_poison_on_resume(poison != 0);
    return Status::Ok();
  });
}

TMSL_API int tmsl_get_poison_on_resume(void* handle, int* out) {
  return on_saver(handle, [&](Saver& saver) {
    *out = saver.poison_on_resume() ? 1 : 0;
    return Status::Ok();
  });
}

TMSL_API int tmsl_note_graph_capture(void) {
  return guarded([&] {
    const ThreadRegion& region = effective_region();
    return region.saver != nullptr ? region.saver->mark_graph_memory(region.tag) : Status::Ok();
  });
}

TMSL_API int tmsl_tag_state(void* handle, const char* tag, int* state) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(tag != nullptr, "tag must not be NULL");
    if (!s.ok()) return s;
    TagInfo info;
    *state = !saver.tag_info(tag, &info) ? 0 : info.paused ? 2 : 1;
    return Status::Ok();
  });
}

TMSL_API int tmsl_wait_for_released_backups(void* handle) {
  return on_saver(handle, [&](Saver& saver) {
    saver.wait_for_released_backups();
    return Status::Ok();
  });
}

TMSL_API const char* tmsl_process_defaults_error(void) {
  return process_defaults().error.c_str();
}

TMSL_API int tmsl_malloc(void* handle, size_t size, int device, const char* tag,
                         int enable_cpu_backup, void** out) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(tag != nullptr && *tag != '\0', "tag must be a non-empty string");
    BackupChoice backup = BackupChoice::kAuto;
    if (s.ok()) s = backup_choice(enable_cpu_backup, &backup);
    if (!s.ok()) return s;
    uintptr_t va = 0;
    s = saver.allocate(size, device, tag, backup, &va);
    *out = reinterpret_cast<void*>(va);
    return s;
  });
}

TMSL_API int tmsl_free(void* handle, void* ptr, void* stream) {
  return on_saver(handle, [&](Saver& saver) { return saver.free(reinterpret_cast<uintptr_t>(ptr), stream); });
}

TMSL_API int tmsl_pause(void* handle, const char* const* tags, int ntags) {
  return on_tags(handle, tags, ntags, &Saver::pause);
}

TMSL_API int tmsl_resume(void* handle, const char* const* tags, int ntags) {
  return on_tags(handle, tags, ntags, &Saver::resume);
}

TMSL_API int tmsl_stats_json(void* handle, char* buf, size_t capacity, size_t* length) {
  return on_saver(handle, [&](Saver& saver) {
    std::string json = saver.stats_json();
    *length = json.size();
    if (buf != nullptr && capacity > json.size()) memcpy(buf, json.c_str(), json.size() + 1);
    return Status::Ok();
  });
}

TMSL_API int tmsl_find_backup(void* handle, const void* ptr, size_t nbytes, const void** host) {
  return on_saver(handle, [&](Saver& saver) {
    return saver.find_backup(reinterpret_cast<uintptr_t>(ptr), nbytes, host);
  });
}

TMSL_API int tmsl_inject_fault(void* handle, const char* operation, long after_calls) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(operation != nullptr, "operation must not be NULL");
    return s.ok() ? saver.backend().inject_fault(operation, after_calls) : s;
  });
}

TMSL_API int tmsl_last_error_code(void) { return static_cast<int>(last_error().code); }

TMSL_API const char* tmsl_last_error_message(void) { return last_error().message.c_str(); }

TMSL_API void tmsl_last_error_oom(const char** tag, size_t* bytes_needed, size_t* bytes_free,
                                  int* device) {
  const OomDetail& oom = last_error().oom;
  *tag = oom.tag.c_str();
  *bytes_needed = oom.bytes_needed;
  *bytes_free = oom.bytes_free;
  *device = oom.device;
}
