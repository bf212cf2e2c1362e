#include "api/c_api.h"
#include "api/node_budget.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "api/abi_guard.h"
#include "platform/environment.h"
#include "platform/options.h"
#include "node/node_store.h"
#include "platform/tag_rules.h"
#include "core/thread_region.h"
#include "tiers/disk_files.h"

using namespace tmsl;

namespace {

thread_local bool t_allocation_failed = false;

Status backup_choice(int value, BackupChoice* out) {
  if (value < -1 || value > kMaxBackupChoice) {
    return Status::Error(Code::kInvalidArgument,
                         "the backup choice must be -1 (not given), 0 (off), 1 (on), 2 (on, host memory given "
                         "back at resume) or 3 (disk)");
  }
  *out = static_cast<BackupChoice>(value);
  return Status::Ok();
}

// The thread region for (saver, tag, backup), argument checks included.
Status region_for(void* handle, const char* tag, int enable_cpu_backup, ThreadRegion* out, SaverRef* saver) {
  Status s = live_saver(handle, saver);
  if (s.ok()) s = check_tag(tag);
  if (s.ok()) s = backup_choice(enable_cpu_backup, &out->backup);
  if (!s.ok()) return s;
  out->saver = reinterpret_cast<SaverHandle>(handle);
  out->tag = tag;
  return Status::Ok();
}

Status tag_selection(const char* const* tags, int ntags, TagSelection* out) {
  out->all = ntags < 0;
  if (ntags > 0 && tags == nullptr) return Status::Error(Code::kInvalidArgument, "tags must not be NULL");
  for (int i = 0; i < ntags; ++i) {
    Status s = check_tag(tags[i]);
    if (!s.ok()) return s;
    out->tags.insert(tags[i]);
  }
  return Status::Ok();
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

// `text` into out[capacity], NUL-terminated; refused (nothing written) when it does not fit.
Status copy_out(const std::string& text, char* out, size_t capacity) {
  if (out == nullptr) return Status::Error(Code::kInvalidArgument, "out must not be NULL");
  if (text.size() >= capacity) {
    return Status::Error(Code::kInvalidArgument, "the value (" + std::to_string(text.size()) +
                                                     " bytes) does not fit in out: give a capacity above it");
  }
  memcpy(out, text.c_str(), text.size() + 1);
  return Status::Ok();
}

}  // namespace

namespace tmsl {
void note_allocation_failure(const Status& status) {
  set_last_error(status);
  t_allocation_failed = true;
}
}  // namespace tmsl

TMSL_API const char* tmsl_version(void) { return TMSL_VERSION; }

TMSL_API const char* tmsl_status_names(void) { return status_code_names(); }

TMSL_API int tmsl_last_error_code(void) { return static_cast<int>(last_error().code); }

TMSL_API const char* tmsl_last_error_message(void) { return last_error().message().c_str(); }

TMSL_API void tmsl_last_error_oom(const char** tag, size_t* bytes_needed, size_t* bytes_free,
                                  int* device) {
  const OomDetail& oom = last_error().oom();
  if (tag != nullptr) *tag = oom.tag.c_str();
  if (bytes_needed != nullptr) *bytes_needed = oom.bytes_needed;
  if (bytes_free != nullptr) *bytes_free = oom.bytes_free;
  if (device != nullptr) *device = oom.device;
}

TMSL_API int tmsl_take_allocation_failure(void) {
  const bool failed = t_allocation_failed;
  t_allocation_failed = false;
  return failed ? 1 : 0;
}

TMSL_API int tmsl_check_process(void) {
  return guarded([] { return in_forked_child() ? forked_child_error() : Status::Ok(); });
}

TMSL_API int tmsl_existing_default_saver(void** out) {
  return guarded([&] {
    Status s = require(out != nullptr, "out must not be NULL");
    if (s.ok()) *out = reinterpret_cast<void*>(existing_default_saver());
    return s;
  });
}

TMSL_API int tmsl_host_memory(TmslHostMemory* out) {
  return guarded([&] {
    Status s = require(out != nullptr, "out must not be NULL");
    if (!s.ok()) return s;
    const NodeFigures node = node_figures();
    const NodeLedger::Figures& f = node.ledger;
    *out = TmslHostMemory{};
    out->active = f.active ? 1 : 0;
    out->budget_bytes = f.budget;
    out->held_by_this_process = f.held_here;
    out->held_by_others = f.held_by_others;
    out->shared_bytes = f.shared;
    out->holder_count = f.holders.size();
    for (size_t i = 0; i < f.holders.size() && i < TMSL_MAX_HOLDERS; ++i) {
      out->holder_pid[i] = f.holders[i].pid;
      out->holder_bytes[i] = f.holders[i].bytes;
      out->holder_cached_bytes[i] = f.holders[i].cached;
      out->holder_entry[i] = f.holders[i].entry;
      out->holder_this_process[i] = f.holders[i].this_process ? 1 : 0;
      out->holder_shared_bytes[i] = f.holders[i].shared;
    }
    snprintf(out->path, sizeof(out->path), "%s", f.path.c_str());
    snprintf(out->error, sizeof(out->error), "%s", f.error.c_str());
    out->backups_shared = node.backups_shared ? 1 : 0;
    snprintf(out->sharing_off, sizeof(out->sharing_off), "%s", node.sharing_off.c_str());
    snprintf(out->store, sizeof(out->store), "%s", node.store.c_str());
    out->alone = node.alone ? 1 : 0;
    return s;
  });
}

TMSL_API int tmsl_default_saver(void** out) {
  return guarded([&] {
    Status s = require(out != nullptr, "out must not be NULL");
    SaverHandle handle = 0;
    if (s.ok()) s = default_saver(&saver_setup, process_defaults(), &handle);
    if (s.ok()) *out = reinterpret_cast<void*>(handle);
    return s;
  });
}

TMSL_API int tmsl_enter_region(void* handle, const char* tag, int enable_cpu_backup) {
  return guarded([&] {
    ThreadRegion region;
    SaverRef saver;
    Status s = region_for(handle, tag, enable_cpu_backup, &region, &saver);
    if (s.ok()) s = saver->enter_tag(region.tag, region.backup);
    if (s.ok()) thread_region() = std::move(region);
    return s;
  });
}

TMSL_API int tmsl_set_thread_region(void* handle, const char* tag, int enable_cpu_backup) {
  return guarded([&] {
    ThreadRegion region;  // saver == NULL: back to the process defaults
    Status s;
    if (handle != nullptr) {
      // No liveness check: restoring the region of a saver closed meanwhile must not fail;
      // allocations in it are refused with a clear error instead.
      s = check_tag(tag);
      if (s.ok()) s = backup_choice(enable_cpu_backup, &region.backup);
      if (!s.ok()) return s;
      region.saver = reinterpret_cast<SaverHandle>(handle);
      region.tag = tag;
    }
    thread_region() = std::move(region);
    return s;
  });
}

TMSL_API int tmsl_disable_thread_region(void) {
  return guarded([] {
    ThreadRegion region;
    region.explicit_none = true;
    thread_region() = std::move(region);
    return Status::Ok();
  });
}

TMSL_API int tmsl_note_graph_capture(void) {
  return guarded([] {
    const ThreadRegion& region = effective_region(&saver_setup, process_defaults());
    SaverRef saver = find_saver(region.saver);
    return saver ? saver->mark_graph_memory(region.tag) : Status::Ok();
  });
}

TMSL_API int tmsl_pause(void* handle, const char* const* tags, int ntags, size_t* store_notices) {
  const int status = on_tags(handle, tags, ntags, &Saver::pause);
  if (store_notices != nullptr) *store_notices = NodeStore::notices_waiting();
  return status;
}

TMSL_API int tmsl_resume(void* handle, const char* const* tags, int ntags, size_t* stray_tags, size_t* store_notices) {
  const int status = on_saver(handle, [&](Saver& saver) {
    TagSelection selection;
    Status s = tag_selection(tags, ntags, &selection);
    if (s.ok()) s = saver.resume(selection);
    if (s.ok() && stray_tags != nullptr) *stray_tags = saver.stray_tags_to_tell(selection);
    return s;
  });
  if (store_notices != nullptr) *store_notices = NodeStore::notices_waiting();
  return status;
}

TMSL_API int tmsl_prepare_backups(void* handle, const char* const* tags, int ntags) {
  return on_tags(handle, tags, ntags, &Saver::prepare_backups);
}

TMSL_API int tmsl_spilled_bytes(void* handle, size_t* bytes) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(bytes != nullptr, "bytes must not be NULL");
    if (s.ok()) *bytes = saver.spilled_bytes();
    return s;
  });
}

TMSL_API int tmsl_check_disk_backup_dir(const char* path, int make, char* real, size_t capacity, char* notices,
                                        size_t notices_capacity) {
  return guarded([&] {
    Status s = require(path != nullptr && real != nullptr && capacity > 0 && notices != nullptr &&
                           notices_capacity > 0,
                       "path, real and notices must not be NULL and capacities above 0");
    if (!s.ok()) return s;
    notices[0] = '\0';
    std::string out = path;
    if (make != 0) {
      s = check_directory(path, &out);
      if (s.ok()) {
        const StaleFiles stale = remove_stale_files(out);
        std::string text;
        for (const std::string& line : {stale.removed_notice(out), stale.foreign_notice(out)}) {
          if (!line.empty()) text += line + "\n";
        }
        const size_t n = std::min(text.size(), notices_capacity - 1);
        memcpy(notices, text.data(), n);
        notices[n] = '\0';
      }
    } else {
      const std::string problem = directory_problem(path);
      if (!problem.empty()) s = Status::Error(Code::kInvalidArgument, problem);
    }
    return s.ok() ? copy_out(out, real, capacity) : s;
  });
}

TMSL_API int tmsl_disk_notices(void* handle, char* out, size_t capacity) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(out != nullptr && capacity > 0, "out must not be NULL and capacity above 0");
    if (!s.ok()) return s;
    std::string text;
    for (const std::string& line : saver.disk_notices()) text += line + "\n";
    const size_t n = std::min(text.size(), capacity - 1);
    memcpy(out, text.data(), n);
    out[n] = '\0';
    return Status::Ok();
  });
}

TMSL_API int tmsl_store_notices(char* out, size_t capacity) {
  return guarded([&] {
    Status s = require(out != nullptr && capacity > 0, "out must not be NULL and capacity above 0");
    if (!s.ok()) return s;
    std::string text;
    for (const std::string& line : NodeStore::take_notices()) text += line + "\n";
    const size_t n = std::min(text.size(), capacity - 1);
    memcpy(out, text.data(), n);
    out[n] = '\0';
    return Status::Ok();
  });
}

TMSL_API int tmsl_tag_state(void* handle, const char* tag, int* state) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(tag != nullptr && state != nullptr, "tag and state must not be NULL");
    if (!s.ok()) return s;
    TagInfo info;
    *state = !saver.tag_info(tag, &info) ? 0 : info.paused ? 2 : 1;
    return Status::Ok();
  });
}

TMSL_API int tmsl_take_stray_writes(void* handle, const char* tag, uint64_t* count, int* mode) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = check_tag(tag);
    if (s.ok()) s = require(count != nullptr && mode != nullptr, "count and mode must not be NULL");
    size_t seen = 0;
    StrayMode followed = StrayMode::kWarn;
    if (s.ok()) s = saver.take_stray_writes(tag, &seen, &followed);
    if (s.ok()) {
      *count = seen;
      *mode = static_cast<int>(followed);
    }
    return s;
  });
}

TMSL_API int tmsl_stray_scratch_bytes(void* handle, int device, uint64_t* out) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(out != nullptr, "out must not be NULL");
    if (s.ok()) *out = saver.stray_scratch_bytes(device);
    return s;
  });
}

TMSL_API int tmsl_tag_allocations(void* handle, const char* tag, uint64_t* addresses, uint64_t* sizes,
                                  int* devices, int* choices, size_t capacity, size_t* count) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(tag != nullptr && count != nullptr, "tag and count must not be NULL");
    if (s.ok() && capacity > 0) {
      s = require(addresses != nullptr && sizes != nullptr && devices != nullptr && choices != nullptr,
                  "addresses, sizes, devices and choices must not be NULL when capacity > 0");
    }
    if (!s.ok()) return s;
    std::vector<Saver::Range> ranges = saver.allocations_of(tag);
    *count = ranges.size();
    for (size_t i = 0; i < ranges.size() && i < capacity; ++i) {
      addresses[i] = ranges[i].va;
      sizes[i] = ranges[i].size;
      devices[i] = ranges[i].device;
      choices[i] = static_cast<int>(ranges[i].choice);
    }
    return Status::Ok();
  });
}

TMSL_API int tmsl_release_host_cache(void* handle) {
  return on_saver(handle, [&](Saver& saver) {
    saver.release_host_cache();
    return Status::Ok();
  });
}

namespace {

// The process's value of an option: what a new saver starts with (the environment's, else the
// table's default), a tag's default, or the node's value.
Status process_option(const OptionRow& row, std::string* out) {
  const ProcessDefaults& d = process_defaults();
  if (row.id == Option::kHostMemoryBudget) {
    *out = std::to_string(node_ledger().figures().budget);
  } else if (row.id == Option::kHostCacheBytes) {
    *out = std::to_string(BackupTiers::default_cache_bytes(d.keeps_host_cache));
  } else if (row.id == Option::kDiskBackupDir) {
    *out = d.disk_backup_dir;
  } else if (saver_holds(row)) {
    *out = format_option(row, d.saver_options[static_cast<size_t>(row.id)]);
  } else {
    *out = row.fallback;
  }
  return Status::Ok();
}

Status named_option(const char* name, const OptionRow** row) {
  Status s = require(name != nullptr, "name must not be NULL");
  return s.ok() ? find_option(name, row) : s;
}

}  // namespace

TMSL_API int tmsl_set_option(void* handle, const char* tag, const char* name, const char* value) {
  return guarded([&] {
    const OptionRow* row = nullptr;
    Status s = named_option(name, &row);
    if (s.ok()) s = require(value != nullptr, "value must not be NULL");
    if (s.ok() && tag != nullptr) s = check_tag(tag);
    if (!s.ok()) return s;
    if (handle == nullptr) {
      if (row->id != Option::kHostMemoryBudget) {
        return Status::Error(Code::kInvalidArgument, std::string("option '") + row->name +
                                                         "' is set on a saver (or a tag), not for the node");
      }
      uint64_t bytes = 0;
      s = parse_option(*row, value, &bytes);
      return s.ok() ? node_ledger().set_budget(static_cast<size_t>(bytes)) : s;
    }
    SaverRef saver;
    s = live_saver(handle, &saver);
    if (!s.ok()) return s;
    return tag != nullptr ? saver->set_tag_option(tag, *row, value) : saver->set_option(*row, value);
  });
}

TMSL_API int tmsl_get_option(void* handle, const char* tag, const char* name, char* out, size_t capacity) {
  return guarded([&] {
    const OptionRow* row = nullptr;
    Status s = named_option(name, &row);
    if (s.ok() && tag != nullptr) s = check_tag(tag);
    if (!s.ok()) return s;
    std::string text;
    if (handle == nullptr) {
      s = process_option(*row, &text);
    } else {
      SaverRef saver;
      s = live_saver(handle, &saver);
      if (s.ok()) s = tag != nullptr ? saver->tag_option(tag, *row, &text) : saver->option(*row, &text);
    }
    return s.ok() ? copy_out(text, out, capacity) : s;
  });
}

TMSL_API int tmsl_options(char* out, size_t capacity, size_t* length) {
  return guarded([&] {
    const std::string text = option_table_text();
    Status s = require(length != nullptr, "length must not be NULL");
    if (s.ok()) *length = text.size();
    if (s.ok() && out != nullptr && capacity > 0) {
      const size_t n = std::min(text.size(), capacity - 1);
      memcpy(out, text.c_str(), n);
      out[n] = '\0';
    }
    return s;
  });
}

TMSL_API int tmsl_wait_for_released_backups(void* handle) {
  return on_saver(handle, [&](Saver& saver) {
    saver.wait_for_released_backups();
    return Status::Ok();
  });
}

static_assert(kMaxTagBytes == TMSL_MAX_TAG_BYTES, "c_api.h and tag_rules.h name one limit");

TMSL_API int tmsl_tag_figures(void* handle, TmslTagFigures* out, size_t capacity, size_t* count) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(count != nullptr && (out != nullptr || capacity == 0), "count (and out, with a capacity) "
                                                                              "must not be NULL");
    if (!s.ok()) return s;
    const std::vector<TagFigures> figures = saver.figures();
    *count = figures.size();
    for (size_t i = 0; i < figures.size() && i < capacity; ++i) {
      const TagFigures& f = figures[i];
      TmslTagFigures& o = out[i];
      const size_t n = std::min(f.tag.size(), static_cast<size_t>(TMSL_MAX_TAG_BYTES));  // the rule keeps it within
      memcpy(o.tag, f.tag.data(), n);
      o.tag[n] = '\0';
      o.device = f.device;
      o.paused = f.info.paused;
      o.graph_memory = f.info.graph_memory;
      o.backs_up = f.backs_up;
      o.allocations = f.allocations;
      o.reserved_bytes = f.reserved;
      o.resident_bytes = f.resident;
      o.paused_bytes = f.paused_bytes;
      o.host_backup_bytes = f.host_backup;
      o.last_pause_seconds = f.info.last_pause_seconds;
      o.last_resume_seconds = f.info.last_resume_seconds;
      o.disk_backup_bytes = f.disk_backup;
      o.last_wake_check = static_cast<int>(f.info.last_wake_check);
      o.paused_in_host = f.paused_in_host;
      o.paused_in_store = f.paused_in_store;
      o.paused_on_disk = f.paused_on_disk;
      o.paused_discarded = f.paused_discarded;
      o.stray_writes = 0;  // this device's; a tag without allocations (device -1): all of them
      for (const auto& [device, writes] : f.info.stray_writes) {
        if (f.device == -1 || device == f.device) o.stray_writes += writes;
      }
    }
    return Status::Ok();
  });
}

TMSL_API int tmsl_check_tag(const char* tag, size_t length) {
  return guarded([&] { return check_tag(tag, length); });
}

TMSL_API int tmsl_lease_backup(void* handle, const void* ptr, size_t nbytes, const void** host, void** lease) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(host != nullptr && lease != nullptr, "host and lease must not be NULL");
    HostBuffer buffer;
    if (s.ok()) s = saver.lease_backup(reinterpret_cast<uintptr_t>(ptr), nbytes, host, &buffer);
    if (s.ok()) *lease = buffer ? new HostBuffer(std::move(buffer)) : nullptr;
    return s;
  });
}

TMSL_API int tmsl_paused_tag_in(void* handle, const void* ptr, size_t nbytes, int* paused, char* tag,
                                size_t capacity) {
  return on_saver(handle, [&](Saver& saver) {
    Status s = require(paused != nullptr && tag != nullptr && capacity > 0, "paused and tag (with a capacity) must not be NULL");
    if (!s.ok()) return s;
    std::string found;
    *paused = saver.paused_tag_in(reinterpret_cast<uintptr_t>(ptr), nbytes, &found) ? 1 : 0;
    const size_t n = std::min(found.size(), capacity - 1);
    memcpy(tag, found.data(), n);
    tag[n] = '\0';
    return Status::Ok();
  });
}

TMSL_API int tmsl_release_lease(void* lease) {
  return guarded([&] {
    // In a forked child the arena (its threads, its page-locking) is the parent's: leave it.
    if (in_forked_child()) return Status::Ok();
    HostBuffer* buffer = static_cast<HostBuffer*>(lease);
    if (*buffer) buffer->arena->end_lease();
    delete buffer;  // the last reference frees it
    return Status::Ok();
  });
}

TMSL_API const char* tmsl_process_defaults_error(void) {
  return process_defaults().error.c_str();
}

TMSL_API int tmsl_process_defaults(TmslProcessDefaults* out) {
  return guarded([&] {
    Status s = require(out != nullptr, "out must not be NULL");
    if (!s.ok()) return s;
    const ProcessDefaults& d = process_defaults();
    static_assert(sizeof(out->disk_backup_dir) == kMaxDiskBackupDirBytes, "environment.h keeps the path within");
    *out = TmslProcessDefaults{};
    out->region_all_threads = d.all_threads;
    out->backup_choice = static_cast<int>(d.backup);
    out->caches_backups = d.caches_backups;
    // The tag rule, the two variable names and the path limit keep these within their arrays.
    memcpy(out->tag, d.tag.c_str(), std::min(d.tag.size(), sizeof(out->tag) - 1));
    memcpy(out->disk_backup_dir_variable, d.disk_backup_dir_variable.c_str(),
           std::min(d.disk_backup_dir_variable.size(), sizeof(out->disk_backup_dir_variable) - 1));
    memcpy(out->disk_backup_dir, d.disk_backup_dir.c_str(), d.disk_backup_dir.size());
    out->share_backups = d.share_backups;
    out->like_torch_memory_saver = d.like_torch_memory_saver;
    return Status::Ok();
  });
}

TMSL_API int tmsl_disk_backup_settings(uint64_t* chunk_bytes, uint64_t* workers) {
  return guarded([&] {
    Status s = require(chunk_bytes != nullptr && workers != nullptr, "chunk_bytes and workers must not be NULL");
    size_t chunk = 0, count = 0;
    if (s.ok()) s = disk_backup_settings(&chunk, &count);
    if (s.ok()) *chunk_bytes = chunk, *workers = count;
    return s;
  });
}

