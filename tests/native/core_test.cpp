// The saver core through its C ABI on the host backend (and the CUDA backend over the fake
// driver in tests/fake_cuda), as a plain executable, so it can run under
// AddressSanitizer + UndefinedBehaviorSanitizer and under ThreadSanitizer
// (`make sanitize`). Prints "N passed, M failed"; exits non-zero on any failure.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/api/c_api_testing.h"
#include "../../csrc/node/chunk_store.h"
#include "../../csrc/node/host_budget.h"
#include "../../csrc/platform/backend.h"
#include "../../csrc/tiers/backup.h"
#include "../../csrc/tiers/host_copies.h"

namespace {

constexpr size_t MiB = 1 << 20;
int g_failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "  %s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #cond, \
              tmsl_last_error_message());                                            \
      ++g_failures;                                                                  \
    }                                                                                \
  } while (0)

struct Saver {
  void* handle = nullptr;
  explicit Saver(size_t capacity = 0) { tmsl_create_host_saver(capacity, 2 * MiB, &handle); }
  ~Saver() { tmsl_destroy_saver(handle); }
  void* malloc(size_t size, const char* tag, bool backup) {
    void* p = nullptr;
    return tmsl_malloc(handle, size, 0, tag, backup, &p) == 0 ? p : nullptr;
  }
  int pause(const char* tag) { return tag ? tmsl_pause(handle, &tag, 1, nullptr) : tmsl_pause(handle, nullptr, -1, nullptr); }
  int resume(const char* tag) {
    return tag ? tmsl_resume(handle, &tag, 1, nullptr, nullptr) : tmsl_resume(handle, nullptr, -1, nullptr, nullptr);
  }
  std::vector<TmslTagFigures> figures() {
    std::vector<TmslTagFigures> out(16);
    size_t count = 0;
    if (tmsl_tag_figures(handle, out.data(), out.size(), &count) != 0) return {};
    out.resize(std::min(count, out.size()));
    return out;
  }
};

bool filled_with(const void* p, size_t size, unsigned char value) {
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < size; ++i) {
    if (bytes[i] != value) return false;
  }
  return true;
}

void backup_round_trip() {
  Saver s;
  std::vector<void*> ptrs;
  for (int i = 0; i < 3; ++i) {
    ptrs.push_back(s.malloc(3 * MiB + 17, "weights", true));
    CHECK(ptrs.back() != nullptr);
    memset(ptrs.back(), 'a' + i, 3 * MiB + 17);
  }
  CHECK(s.pause("weights") == 0);
  CHECK(s.pause("weights") == 0);  // a no-op
  CHECK(s.resume("weights") == 0);
  for (int i = 0; i < 3; ++i) CHECK(filled_with(ptrs[i], 3 * MiB + 17, 'a' + i));
  for (void* p : ptrs) CHECK(tmsl_free(s.handle, p, nullptr) == 0);
}

// 150 MiB is page-locked in several ranges that a registrar thread and fault-in workers
// prepare while the pause copies; a lease makes it one registration, and the next cycle
// copies through that (the host backend refuses a copy across registrations, as CUDA does).
void large_backup_round_trips_in_parts_and_leases_whole() {
  Saver s;
  const size_t sizes[] = {3 * MiB, 150 * MiB, 5 * MiB};
  std::vector<void*> ptrs;
  for (size_t size : sizes) ptrs.push_back(s.malloc(size, "weights", true));
  for (void* p : ptrs) CHECK(p != nullptr);
  for (int cycle = 0; cycle < 2; ++cycle) {
    for (size_t i = 0; i < ptrs.size(); ++i) memset(ptrs[i], 'a' + cycle * 3 + static_cast<int>(i), sizes[i]);
    CHECK(s.pause("weights") == 0);
    const void* host = nullptr;
    void* lease = nullptr;
    CHECK(tmsl_lease_backup(s.handle, ptrs[1], sizes[1], &host, &lease) == 0);
    CHECK(host != nullptr && filled_with(host, sizes[1], 'a' + cycle * 3 + 1));
    CHECK(tmsl_release_lease(lease) == 0);
    CHECK(s.resume("weights") == 0);
    for (size_t i = 0; i < ptrs.size(); ++i) CHECK(filled_with(ptrs[i], sizes[i], 'a' + cycle * 3 + static_cast<int>(i)));
  }
  for (void* p : ptrs) CHECK(tmsl_free(s.handle, p, nullptr) == 0);
}

void no_backup_gets_fresh_zero_memory() {
  Saver s;
  void* p = s.malloc(4 * MiB, "kv", false);
  memset(p, 0x5a, 4 * MiB);
  CHECK(s.pause("kv") == 0);
  CHECK(s.resume("kv") == 0);
  CHECK(filled_with(p, 4 * MiB, 0));
  CHECK(tmsl_free(s.handle, p, nullptr) == 0);
}

void free_while_paused_and_bad_frees() {
  Saver s;
  void* p = s.malloc(2 * MiB, "kv", true);
  CHECK(s.pause("kv") == 0);
  CHECK(tmsl_free(s.handle, p, nullptr) == 0);
  CHECK(tmsl_free(s.handle, p, nullptr) != 0);  // twice
  CHECK(strstr(tmsl_last_error_message(), "freed twice") != nullptr);
  int local = 0;
  CHECK(tmsl_free(s.handle, &local, nullptr) != 0);  // never allocated
  const std::vector<TmslTagFigures> figures = s.figures();  // the tag stays paused; its pause was timed
  CHECK(figures.size() == 1);
  const TmslTagFigures& kv = figures[0];
  CHECK(strcmp(kv.tag, "kv") == 0 && kv.device == -1 && kv.allocations == 0 && kv.reserved_bytes == 0);
  CHECK(kv.resident_bytes == 0 && kv.paused_bytes == 0 && kv.host_backup_bytes == 0);
  CHECK(kv.paused == 1 && kv.graph_memory == 0 && kv.backs_up == 1);
  CHECK(kv.last_pause_seconds >= 0 && kv.last_resume_seconds < 0);
}

void out_of_memory_resume_rolls_back_and_retries() {
  Saver s(16 * MiB);
  void* a = s.malloc(6 * MiB, "weights", true);
  void* b = s.malloc(6 * MiB, "weights", true);
  memset(a, 1, 6 * MiB);
  memset(b, 2, 6 * MiB);
  CHECK(s.pause("weights") == 0);
  void* hog = s.malloc(8 * MiB, "other", false);
  CHECK(hog != nullptr);
  CHECK(s.resume("weights") == 2);  // out of memory
  const char* tag = nullptr;
  size_t needed = 0, free_bytes = 0;
  int device = -1;
  tmsl_last_error_oom(&tag, &needed, &free_bytes, &device);
  CHECK(std::string(tag) == "weights" && needed == 12 * MiB && free_bytes == 8 * MiB);
  CHECK(tmsl_free(s.handle, hog, nullptr) == 0);
  CHECK(s.resume("weights") == 0);
  CHECK(filled_with(a, 6 * MiB, 1) && filled_with(b, 6 * MiB, 2));
}

void injected_faults_keep_state_recoverable() {
  Saver s;
  void* p = s.malloc(4 * MiB, "weights", true);
  memset(p, 7, 4 * MiB);
  CHECK(tmsl_inject_fault(s.handle, "copy_to_host_async", 1, 1) == 0);
  CHECK(s.pause("weights") != 0);
  CHECK(filled_with(p, 4 * MiB, 7));  // still resident
  CHECK(s.pause("weights") == 0);
  CHECK(tmsl_inject_fault(s.handle, "set_access", 1, 1) == 0);
  CHECK(s.resume("weights") != 0);
  CHECK(s.resume("weights") == 0);
  CHECK(filled_with(p, 4 * MiB, 7));
}

void retained_backups_are_reused_and_fresh() {
  Saver s;
  CHECK(tmsl_set_option(s.handle, nullptr, "retain_cpu_backup", "1") == 0);
  void* p = s.malloc(4 * MiB, "weights", true);
  for (unsigned char round = 1; round <= 5; ++round) {
    memset(p, round, 4 * MiB);
    CHECK(s.pause("weights") == 0);
    CHECK(s.resume("weights") == 0);
    CHECK(filled_with(p, 4 * MiB, round));
  }
  CHECK(tmsl_wait_for_released_backups(s.handle) == 0);
}

void hooks_route_by_thread_region() {
  Saver s;
  CHECK(tmsl_torch_malloc(2 * MiB, 0, nullptr) == nullptr);  // no region: refused
  CHECK(tmsl_set_thread_region(s.handle, "kv", 0) == 0);
  void* p = tmsl_torch_malloc(2 * MiB, 0, nullptr);
  CHECK(p != nullptr);
  CHECK(tmsl_set_thread_region(nullptr, nullptr, 0) == 0);
  tmsl_torch_free(p, 2 * MiB, 0, nullptr);
  CHECK(tmsl_free(s.handle, p, nullptr) != 0);  // already freed through the hook
}

void destroyed_saver_handles_reach_nothing() {
  void* old_handle = nullptr;
  {
    Saver s;
    old_handle = s.handle;
    CHECK(tmsl_enter_region(s.handle, "kv", -1) == 0);  // this thread's region names it
  }
  // The region outlived its saver: allocating in it is refused with a clear error.
  CHECK(tmsl_torch_malloc(2 * MiB, 0, nullptr) == nullptr);
  CHECK(strstr(tmsl_last_error_message(), "has been closed") != nullptr);
  CHECK(tmsl_take_allocation_failure() == 1);
  CHECK(tmsl_take_allocation_failure() == 0);
  Saver fresh;  // may take the same slot: the old handle must not reach it
  CHECK(tmsl_pause(old_handle, nullptr, -1, nullptr) != 0);
  CHECK(strstr(tmsl_last_error_message(), "destroyed saver handle") != nullptr);
  CHECK(tmsl_destroy_saver(old_handle) != 0);
  CHECK(tmsl_set_thread_region(nullptr, nullptr, 0) == 0);
}

// Destroying a saver while one thread pauses and resumes it and another frees pointers that
// are not the saver's (every cudaFree asks each saver "is this yours?"): no use after free.
void destroy_races_with_pauses_and_foreign_frees() {
  for (int round = 0; round < 20; ++round) {
    void* handle = nullptr;
    CHECK(tmsl_create_host_saver(0, 2 * MiB, &handle) == 0);
    void* p = nullptr;
    CHECK(tmsl_malloc(handle, 4 * MiB, 0, "kv", 1, &p) == 0);
    std::atomic<bool> go{false};
    std::thread pauser([&] {
      while (!go) std::this_thread::yield();
      for (int i = 0; i < 50; ++i) {
        if (tmsl_pause(handle, nullptr, -1, nullptr) != 0 || tmsl_resume(handle, nullptr, -1, nullptr, nullptr) != 0) break;
      }
    });
    std::thread freer([&] {
      int local = 0;
      while (!go) std::this_thread::yield();
      for (int i = 0; i < 2000; ++i) tmsl_torch_free(&local, 0, 0, nullptr);
    });
    go = true;
    CHECK(tmsl_destroy_saver(handle) == 0);
    pauser.join();
    freer.join();
    CHECK(tmsl_pause(handle, nullptr, -1, nullptr) != 0);  // and the handle is dead for good
  }
}

// Every entry point that writes through a pointer refuses NULL with an error, no crash.
void null_out_pointers_are_refused() {
  Saver s;
  CHECK(tmsl_default_saver(nullptr) != 0);
  CHECK(tmsl_create_host_saver(0, 2 * MiB, nullptr) != 0);
  CHECK(tmsl_malloc(s.handle, MiB, 0, "kv", 0, nullptr) != 0);
  CHECK(tmsl_tag_figures(s.handle, nullptr, 0, nullptr) != 0);
  CHECK(tmsl_check_tag("kv", 2) == 0 && tmsl_check_tag("", 0) != 0 && tmsl_check_tag("a\0b", 3) != 0);
  CHECK(tmsl_check_tag("\xff", 1) != 0 && tmsl_check_tag(nullptr, 0) != 0);
  CHECK(tmsl_tag_state(s.handle, "kv", nullptr) != 0);
  CHECK(tmsl_tag_state(s.handle, nullptr, nullptr) != 0);
  char value[8];
  CHECK(tmsl_get_option(s.handle, nullptr, "poison_on_resume", nullptr, 8) != 0);
  CHECK(tmsl_get_option(s.handle, nullptr, "host_cache_bytes", value, 1) != 0);  // no room for the digits
  CHECK(tmsl_get_option(s.handle, nullptr, "no_such_option", value, 8) != 0);
  CHECK(tmsl_set_option(s.handle, nullptr, "verify_wake", "maybe") != 0);
  CHECK(tmsl_set_option(s.handle, nullptr, "verify_wake", nullptr) != 0);
  CHECK(tmsl_set_option(s.handle, "kv", "poison_on_resume", "1") != 0);  // not a tag's
  CHECK(tmsl_set_option(nullptr, nullptr, "verify_wake", "1") != 0);  // not the node's
  const void* host = nullptr;
  CHECK(tmsl_lease_backup(s.handle, nullptr, 1, nullptr, nullptr) != 0);
  CHECK(tmsl_lease_backup(s.handle, nullptr, 1, &host, nullptr) != 0);
  CHECK(tmsl_pause(s.handle, nullptr, 2, nullptr) != 0);  // two tags promised, none given
  CHECK(tmsl_enter_region(s.handle, nullptr, 0) != 0);
  CHECK(tmsl_inject_fault(s.handle, nullptr, 1, 1) != 0);
  tmsl_last_error_oom(nullptr, nullptr, nullptr, nullptr);
  CHECK(tmsl_set_thread_region(s.handle, "kv", 0) == 0);
  CHECK(cudaMalloc(nullptr, MiB) != 0);  // inside a region: the result pointer is needed
  CHECK(tmsl_set_thread_region(nullptr, nullptr, 0) == 0);
}

void threads_allocate_and_free_while_another_tag_cycles() {
  Saver s;
  std::vector<void*> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(s.malloc(2 * MiB, "idle", true));
    memset(idle.back(), 'i' + i, 2 * MiB);
  }
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        size_t size = (1 + (t + i) % 3) * MiB;
        void* p = s.malloc(size, t % 2 ? "busy-1" : "busy-0", t % 2 == 0);  // one setting a tag
        if (p == nullptr) {
          ++errors;
          continue;
        }
        memset(p, t, size);
        if (!filled_with(p, size, static_cast<unsigned char>(t))) ++errors;
        if (tmsl_free(s.handle, p, nullptr) != 0) ++errors;
      }
    });
  }
  std::thread cycler([&] {
    while (!stop) {
      if (s.pause("idle") != 0 || s.resume("idle") != 0) ++errors;
      for (int i = 0; i < 4; ++i) {
        if (!filled_with(idle[i], 2 * MiB, 'i' + i)) ++errors;
      }
    }
  });
  std::thread reader([&] {
    while (!stop) {
      if (s.figures().empty()) ++errors;
    }
  });
  for (auto& t : threads) t.join();
  stop = true;
  cycler.join();
  reader.join();
  CHECK(errors == 0);
}

// The CUDA backend (csrc/platform/backend_cuda.cpp) over tests/fake_cuda, host memory standing in
// for a GPU: threads whose allocations are the device's first use (its context looked up
// once, then read without a lock), then a pause and a resume of them all.
void cuda_backend_over_the_fake_driver() {
#ifdef TMSL_FAKE_DRIVER
  setenv("TMSL_CUDA_DRIVER_LIBRARY", TMSL_FAKE_DRIVER, 1);
  void* handle = nullptr;
  CHECK(tmsl_default_saver(&handle) == 0);
  if (handle == nullptr) return;
  constexpr int kThreads = 8, kEach = 8;
  void* ptrs[kThreads][kEach] = {};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const std::string tag = "fake-" + std::to_string(t);
        if (tmsl_malloc(handle, 2 * MiB, 0, tag.c_str(), 1, &ptrs[t][i]) == 0) {
          memset(ptrs[t][i], t * kEach + i, 2 * MiB);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& row : ptrs) {
    for (void* p : row) CHECK(p != nullptr);
  }
  // No host cache: the backups' arena goes (its threads joined) once the resume is done, as
  // this saver, the process-wide one, outlives the test.
  CHECK(tmsl_set_option(handle, nullptr, "host_cache_bytes", "0") == 0);
  CHECK(tmsl_pause(handle, nullptr, -1, nullptr) == 0);
  CHECK(tmsl_resume(handle, nullptr, -1, nullptr, nullptr) == 0);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kEach; ++i) {
      if (ptrs[t][i] == nullptr) continue;
      CHECK(filled_with(ptrs[t][i], 2 * MiB, static_cast<unsigned char>(t * kEach + i)));
      CHECK(tmsl_free(handle, ptrs[t][i], nullptr) == 0);
    }
  }
  CHECK(tmsl_wait_for_released_backups(handle) == 0);
#endif
}

// The disk tier: files in a directory on a disk (under build/, never tmpfs), one per
// allocation while paused, content bit for bit after resume, removed at resume and free.
std::string disk_test_dir() {
  mkdir("build", 0777);
  return "build/native-disk-test-" + std::to_string(getpid());
}

size_t files_in(const std::string& directory) {
  size_t n = 0;
  if (DIR* dir = opendir(directory.c_str())) {
    while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

bool patterned(const void* p, size_t size, unsigned seed) {
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < size; ++i) {
    if (bytes[i] != static_cast<unsigned char>(i * 7 + seed)) return false;
  }
  return true;
}

void fill_pattern(void* p, size_t size, unsigned seed) {
  auto* bytes = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + seed);
}

void disk_backup_round_trips_and_removes_its_files() {
  const std::string dir = disk_test_dir();
  setenv("TMSL_DISK_BACKUP_CHUNK_MB", "1", 1);  // several chunks per allocation, on several workers
  {
    Saver s;
    CHECK(tmsl_set_option(s.handle, nullptr, "disk_backup_dir", dir.c_str()) == 0);
    const size_t sizes[] = {6 * MiB, 2 * MiB};
    void* p[2] = {nullptr, nullptr};
    for (int i = 0; i < 2; ++i) {
      CHECK(tmsl_malloc(s.handle, sizes[i], 0, "disk", 3, &p[i]) == 0);
      if (p[i] != nullptr) fill_pattern(p[i], sizes[i], i + 1);
    }
    for (int cycle = 0; cycle < 2; ++cycle) {
      CHECK(s.pause("disk") == 0);
      CHECK(files_in(dir) == 2);
      auto figures = s.figures();
      CHECK(figures.size() == 1 && figures[0].disk_backup_bytes == 8 * MiB && figures[0].resident_bytes == 0 &&
            figures[0].host_backup_bytes == 0);
      CHECK(s.resume("disk") == 0);
      CHECK(files_in(dir) == 0);
      for (int i = 0; i < 2; ++i) CHECK(p[i] != nullptr && patterned(p[i], sizes[i], i + 1));
    }
    CHECK(s.pause("disk") == 0);
    CHECK(tmsl_free(s.handle, p[0], nullptr) == 0);  // a free while paused removes its file
    CHECK(files_in(dir) == 1);
  }  // the saver's end removes the rest
  CHECK(files_in(dir) == 0);
  unsetenv("TMSL_DISK_BACKUP_CHUNK_MB");
  rmdir(dir.c_str());
}

void failed_disk_write_leaves_everything_resident() {
  const std::string dir = disk_test_dir();
  Saver s;
  CHECK(tmsl_set_option(s.handle, nullptr, "disk_backup_dir", dir.c_str()) == 0);
  void* p = nullptr;
  CHECK(tmsl_malloc(s.handle, 4 * MiB, 0, "disk", 3, &p) == 0);
  if (p != nullptr) fill_pattern(p, 4 * MiB, 9);
  CHECK(tmsl_inject_fault(s.handle, "copy_to_host_async", 1, 1) == 0);  // the staging copy fails
  CHECK(s.pause("disk") != 0);
  CHECK(strstr(tmsl_last_error_message(), "the tag stays resident with its content") != nullptr);
  CHECK(files_in(dir) == 0);
  CHECK(p != nullptr && patterned(p, 4 * MiB, 9));
  CHECK(s.pause("disk") == 0);  // and it can be paused again
  CHECK(s.resume("disk") == 0);
  CHECK(p != nullptr && patterned(p, 4 * MiB, 9));
  CHECK(tmsl_free(s.handle, p, nullptr) == 0);
  CHECK(files_in(dir) == 0);
  rmdir(dir.c_str());
}

void disk_directory_on_host_memory_is_refused() {
  Saver s;
  CHECK(tmsl_set_option(s.handle, nullptr, "disk_backup_dir", "/dev/shm/tmsl-native-test") != 0);
  CHECK(strstr(tmsl_last_error_message(), "which is host memory") != nullptr);
  CHECK(access("/dev/shm/tmsl-native-test", F_OK) != 0);  // a refused directory is not left behind
}

}  // namespace

// HostCopies on its own (the backup tiers' store of host copies), over arenas of the host
// backend and a budget without a limit.
struct NoLimit : tmsl::HostBudget {
  tmsl::Status reserve(size_t) override { return tmsl::Status::Ok(); }
  void give_back(size_t) override {}
  void note_cached(const void*, size_t) override {}
  void note_shared(const void*, size_t) override {}
  void on_pressure(const void*, std::function<void()>) override {}
  void forget(const void*) override {}
  bool ask_others_for(size_t, std::chrono::milliseconds) override { return true; }
  size_t room_with_others_caches() override { return SIZE_MAX; }
  bool alone_on_node() override { return false; }
};

// A store of memfds: new chunks are memfds, publishing names nothing but says it did.
struct MemfdStore : tmsl::ChunkStore {
  const tmsl::FingerprintKey* content_key() override { return nullptr; }
  const tmsl::FingerprintKey* store_key_now(tmsl::HostBudget&) override { return nullptr; }
  tmsl::Status open_chunk(const tmsl::Fingerprint&, int* fd, bool* here) override {
    *fd = -1;
    *here = false;
    return tmsl::Status::Ok();
  }
  tmsl::Status new_chunk(size_t size, int* fd) override {
    *fd = memfd_create("chunk", MFD_CLOEXEC);
    return *fd >= 0 && ftruncate(*fd, static_cast<off_t>(size)) == 0 ? tmsl::Status::Ok()
                                                                       : tmsl::Status::Error(tmsl::Code::kHostError, "memfd");
  }
  tmsl::Status publish_chunk(int, const tmsl::Fingerprint&, bool* published) override {
    *published = true;
    ++published_;
    return tmsl::Status::Ok();
  }
  void release_shared(int fd) override {
    close(fd);
    ++released_;
  }
  void discard_chunk(int fd) override { close(fd); }
  tmsl::Status take_back_chunk(int, bool* taken) override {
    *taken = false;
    return tmsl::Status::Ok();
  }
  void retire_chunk(int) override { ++retired_; }
  void adopt_chunk(int retired, int) override {
    close(retired);
    ++adopted_;
  }
  size_t room() override { return SIZE_MAX; }
  size_t room_of(int) override { return SIZE_MAX; }  // (a file that gets no pages still fails at fallocate: FullStore)
  bool wait_while_others_make_chunks(std::chrono::steady_clock::time_point) override { return false; }
  size_t descriptors_left() override { return SIZE_MAX; }
  void note_refusal(const std::string&) override {}
  tmsl::Status claim_chunk(const tmsl::Fingerprint&, int* claim) override {
    *claim = -1;
    return tmsl::Status::Ok();
  }
  void unclaim_chunk(const tmsl::Fingerprint&, int) override {}
  tmsl::Status wait_for_chunk(const tmsl::Fingerprint&, std::chrono::milliseconds, int* fd) override {
    *fd = -1;
    return tmsl::Status::Ok();
  }
  std::atomic<int> published_{0}, released_{0}, retired_{0}, adopted_{0};
};

struct CopiesFixture {
  NoLimit budget;
  MemfdStore store;
  tmsl::ForegroundGate gate;
  std::shared_ptr<tmsl::Backend> backend{tmsl::make_host_backend(0, 2 * MiB)};
  // One arena of `count` buffers of 64 KiB on device 0, taken (note_use) when made.
  std::shared_ptr<tmsl::HostArena> arena(size_t count) {
    std::unique_ptr<tmsl::HostArena> made;
    tmsl::Status s = tmsl::HostArena::create(backend, budget, gate, true, 0, std::vector<size_t>(count, 64 << 10), &made);
    if (!s.ok()) return nullptr;
    made->wait_prepared();
    return std::shared_ptr<tmsl::HostArena>(std::move(made));
  }
  static tmsl::HostBuffer buffer(const std::shared_ptr<tmsl::HostArena>& arena, size_t i) {
    return tmsl::HostBuffer{arena, arena->buffer_offset(i), 64 << 10};
  }
};

void content_arena_maps_held_chunks_and_copies_into_new_ones_only() {
  CopiesFixture f;
  const size_t range = tmsl::HostArena::kRangeBytes, size = range + 2 * MiB;
  // Chunk 0 is the store's already (a file holding 0x5A), chunk 1 is new.
  const int held = memfd_create("held", MFD_CLOEXEC);
  CHECK(held >= 0 && ftruncate(held, static_cast<off_t>(range)) == 0);
  std::vector<char> bytes(range, 0x5A);
  CHECK(pwrite(held, bytes.data(), range, 0) == static_cast<ssize_t>(range));
  std::vector<tmsl::HostArena::Chunk> chunks(2);
  chunks[0].fd = held;
  chunks[0].fingerprint.bytes = range;
  chunks[1].fingerprint.bytes = 2 * MiB;
  chunks[1].fingerprint.lanes[0] = 1;
  CHECK(tmsl::HostArena::chunks_in(size) == 2);
  std::unique_ptr<tmsl::HostArena> made;
  CHECK(tmsl::HostArena::create_content(f.backend, f.budget, f.store, f.gate, 0, size, chunks, &made).ok());
  if (made == nullptr) return;
  std::shared_ptr<tmsl::HostArena> arena(std::move(made));
  tmsl::HostBuffer buffer{arena, 0, size};
  CHECK(arena->is_content() && arena->has_shared() && !arena->poolable());
  CHECK(arena->own_bytes() == 2 * MiB);  // the held chunk is the store's
  CHECK(buffer.data()[0] == 0x5A && buffer.data()[range - 1] == 0x5A);
  const auto parts = arena->writable_parts(0, size);
  CHECK(parts.size() == 1 && parts[0].first == range && parts[0].second == 2 * MiB);
  CHECK(buffer.for_each_part(range, 2 * MiB, [&](char* host, size_t, size_t n) {
          memset(host, 0x33, n);  // what the pause's copy would write
          return tmsl::Status::Ok();
        }).ok());
  arena->publish();
  CHECK(f.store.published_.load() == 1 && arena->own_bytes() == 0);
  const std::vector<tmsl::Fingerprint> content = arena->content();
  CHECK(content.size() == 2 && content[0] == chunks[0].fingerprint && content[1] == chunks[1].fingerprint);
  CHECK(arena->writable_parts(0, size).empty());  // published: never written again
  CHECK(buffer.data()[range] == 0x33);
  buffer = tmsl::HostBuffer();
  arena.reset();
  CHECK(f.store.released_.load() == 2);  // both chunks let go with the arena
}

// A store whose new chunks cannot get their pages (as a /dev/shm filled by others between the
// room check and the copy): /dev/zero maps, but refuses fallocate.
struct FullStore : MemfdStore {
  tmsl::Status new_chunk(size_t, int* fd) override {
    *fd = open("/dev/zero", O_RDWR | O_CLOEXEC);
    return *fd >= 0 ? tmsl::Status::Ok() : tmsl::Status::Error(tmsl::Code::kHostError, "/dev/zero");
  }
};

void content_arena_without_room_in_the_store_copies_into_private_memory() {
  NoLimit budget;
  FullStore store;
  tmsl::ForegroundGate gate;
  std::shared_ptr<tmsl::Backend> backend{tmsl::make_host_backend(0, 2 * MiB)};
  const size_t range = tmsl::HostArena::kRangeBytes, size = 2 * range;
  std::vector<tmsl::HostArena::Chunk> chunks(2);
  for (size_t i = 0; i < 2; ++i) {
    chunks[i].fingerprint.bytes = range;
    chunks[i].fingerprint.lanes[0] = i + 1;
  }
  std::unique_ptr<tmsl::HostArena> made;
  CHECK(tmsl::HostArena::create_content(backend, budget, store, gate, 0, size, chunks, &made).ok());
  if (made == nullptr) return;
  std::shared_ptr<tmsl::HostArena> arena(std::move(made));
  tmsl::HostBuffer buffer{arena, 0, size};
  const auto parts = arena->writable_parts(0, size);
  CHECK(parts.size() == 2);
  for (const auto& [from, n] : parts) {
    CHECK(buffer.for_each_part(from, n, [&](char* host, size_t at, size_t part) {
            memset(host, static_cast<int>(0x40 + at / range), part);  // what the pause's copy would write
            return tmsl::Status::Ok();
          }).ok());
  }
  arena->publish();
  CHECK(store.published_.load() == 0);  // private memory is never named
  CHECK(arena->own_bytes() == size && !arena->has_shared());
  CHECK(buffer.data()[0] == 0x40 && buffer.data()[range - 1] == 0x40 && buffer.data()[range] == 0x41 &&
        buffer.data()[size - 1] == 0x41);
}

// A store whose chunks can be taken back while `take_backs` lasts (node_store.h: this process
// made them and alone holds them), and refused after (another process holds them: a replica
// that never pauses). New bytes are claimed here (a claim is a memfd), counted.
struct RecyclingStore : MemfdStore {
  int take_backs = 0;
  std::atomic<int> claims_{0}, unclaims_{0};
  tmsl::Status take_back_chunk(int, bool* taken) override {
    *taken = take_backs > 0;
    --take_backs;
    return tmsl::Status::Ok();
  }
  tmsl::Status claim_chunk(const tmsl::Fingerprint&, int* claim) override {
    *claim = memfd_create("claim", MFD_CLOEXEC);
    ++claims_;
    return tmsl::Status::Ok();
  }
  void unclaim_chunk(const tmsl::Fingerprint&, int claim) override {
    close(claim);
    ++unclaims_;
  }
};

void changed_content_arena_is_recycled_only_where_every_changed_chunk_is_taken_back() {
  NoLimit budget;
  RecyclingStore store;
  tmsl::ForegroundGate gate;
  std::shared_ptr<tmsl::Backend> backend{tmsl::make_host_backend(0, 2 * MiB)};
  const size_t range = tmsl::HostArena::kRangeBytes, size = 3 * range;
  auto fingerprints = [&](uint64_t seed) {
    std::vector<tmsl::Fingerprint> f(3);
    for (size_t i = 0; i < 3; ++i) {
      f[i].bytes = range;
      f[i].lanes[0] = seed + i;
    }
    return f;
  };
  auto made = [&](std::shared_ptr<tmsl::HostArena>* out) {
    std::vector<tmsl::HostArena::Chunk> chunks(3);
    const auto f = fingerprints(10);
    for (size_t i = 0; i < 3; ++i) chunks[i].fingerprint = f[i];
    std::unique_ptr<tmsl::HostArena> arena;
    CHECK(tmsl::HostArena::create_content(backend, budget, store, gate, 0, size, chunks, &arena).ok());
    if (arena == nullptr) return;
    *out = std::shared_ptr<tmsl::HostArena>(std::move(arena));
    tmsl::HostBuffer buffer{*out, 0, size};
    for (const auto& [from, n] : (*out)->writable_parts(0, size)) {
      CHECK(buffer.for_each_part(from, n, [](char* host, size_t, size_t part) {
              memset(host, 0x11, part);
              return tmsl::Status::Ok();
            }).ok());
    }
    (*out)->publish();
  };
  std::shared_ptr<tmsl::HostArena> arena;
  made(&arena);
  if (arena == nullptr) return;
  CHECK(store.published_.load() == 3 && arena->own_bytes() == 0 && arena->writable_parts(0, size).empty());
  // Chunks 1 and 2 changed, both taken back: the pause copies into them, then names them.
  std::vector<tmsl::Fingerprint> changed = fingerprints(10);
  changed[1].lanes[0] = 99;
  changed[2].lanes[0] = 98;
  store.take_backs = 2;
  CHECK(arena->recycle(changed, std::chrono::steady_clock::now()));
  CHECK(arena->content() == changed && arena->own_bytes() == 2 * range);
  const auto parts = arena->writable_parts(0, size);
  CHECK(parts.size() == 2 && parts[0].first == range && parts[1].first == 2 * range);
  arena->publish();
  CHECK(store.published_.load() == 5 && arena->own_bytes() == 0 && arena->writable_parts(0, size).empty());
  // Changed again, but the second stays held by another process until the replicas' patience
  // ends (claimed meanwhile, so others would wait for it, then let go): nothing recycled, the
  // arena keeps saying what it holds (the bytes before the change), never reused as new.
  std::vector<tmsl::Fingerprint> again = changed;
  again[1].lanes[0] = 77;
  again[2].lanes[0] = 76;
  store.take_backs = 1;
  const auto asked = std::chrono::steady_clock::now();
  CHECK(!arena->recycle(again, asked + std::chrono::milliseconds(30)));
  CHECK(std::chrono::steady_clock::now() - asked >= std::chrono::milliseconds(30));  // it waited that long
  CHECK(store.claims_.load() == 1 && store.unclaims_.load() == 1 && store.retired_.load() == 0);
  CHECK(arena->content() == changed);
  arena->publish();
  CHECK(store.published_.load() == 5);  // the one taken back is never named again
}

// Replicas whose bytes changed alike: another process made this arena's chunks. A changed
// chunk is retired (its file stays mapped and page-locked here) until its maker names the new
// bytes: the same file rewritten in place is adopted as it is mapped; another file is mapped
// in its place; one nobody made is made here.
void replicas_changed_chunks_are_retired_then_adopted_in_place_or_replaced() {
  NoLimit budget;
  RecyclingStore store;  // (take_backs 0: the chunks are another process's, held by others)
  tmsl::ForegroundGate gate;
  std::shared_ptr<tmsl::Backend> backend{tmsl::make_host_backend(0, 2 * MiB)};
  const size_t range = tmsl::HostArena::kRangeBytes, size = 3 * range;
  std::vector<int> files(3);
  std::vector<tmsl::HostArena::Chunk> chunks(3);
  for (size_t i = 0; i < 3; ++i) {
    files[i] = memfd_create("maker's chunk", MFD_CLOEXEC);
    CHECK(files[i] >= 0 && ftruncate(files[i], static_cast<off_t>(range)) == 0);
    std::vector<char> bytes(range, static_cast<char>(0x20 + i));
    CHECK(pwrite(files[i], bytes.data(), range, 0) == static_cast<ssize_t>(range));
    chunks[i].fingerprint.bytes = range;
    chunks[i].fingerprint.lanes[0] = 10 + i;
    chunks[i].fd = dup(files[i]);  // the store's chunk, held (read-only here)
  }
  std::unique_ptr<tmsl::HostArena> made;
  CHECK(tmsl::HostArena::create_content(backend, budget, store, gate, 0, size, chunks, &made).ok());
  if (made == nullptr) return;
  std::shared_ptr<tmsl::HostArena> arena(std::move(made));
  tmsl::HostBuffer buffer{arena, 0, size};
  auto first_byte_of = [&](size_t r) {
    char seen = 0;
    CHECK(buffer.for_each_part(r * range, 1, [&](char* host, size_t, size_t) {
            seen = host[0];
            return tmsl::Status::Ok();
          }).ok());
    return seen;
  };
  CHECK(first_byte_of(0) == 0x20 && first_byte_of(2) == 0x22);
  CHECK(arena->writable_parts(0, size).empty() && arena->has_shared());
  std::vector<tmsl::Fingerprint> changed(3);
  for (size_t i = 0; i < 3; ++i) changed[i] = chunks[i].fingerprint;
  changed[0].lanes[0] = 90;
  changed[1].lanes[0] = 91;
  changed[2].lanes[0] = 92;
  const auto others_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  CHECK(arena->recycle(changed, others_by));  // at once: nothing of its own to wait for
  CHECK(store.retired_.load() == 3 && store.claims_.load() == 0);  // a maker claims, not a holder
  CHECK(arena->pending_chunks() == std::vector<size_t>({0, 1, 2}));
  CHECK(arena->writable_parts(0, size).empty());  // nothing copied here: the makers write them
  CHECK(arena->content().empty());                // not known until they are settled
  CHECK(arena->maker_expected_until(0) == others_by);
  // Chunk 0 rewritten in place by its maker: adopted, no mapping made, the new bytes there.
  std::vector<char> fresh(range, 0x50);
  CHECK(pwrite(files[0], fresh.data(), range, 0) == static_cast<ssize_t>(range));
  CHECK(arena->settle_chunk(0, dup(files[0])).ok());
  CHECK(store.adopted_.load() == 1 && first_byte_of(0) == 0x50);
  // Chunk 1 came as another file: mapped in place of the old one, page-locked at its read.
  const int other = memfd_create("another maker's chunk", MFD_CLOEXEC);
  CHECK(other >= 0 && ftruncate(other, static_cast<off_t>(range)) == 0);
  std::vector<char> elsewhere(range, 0x61);
  CHECK(pwrite(other, elsewhere.data(), range, 0) == static_cast<ssize_t>(range));
  const int released = store.released_.load();
  CHECK(arena->settle_chunk(1, other).ok());
  CHECK(store.released_.load() == released + 1 && store.adopted_.load() == 1);  // the old file let go of
  CHECK(first_byte_of(1) == 0x61);
  // Chunk 2: nobody made it: a new file here, for the pause to copy into and publish.
  CHECK(arena->maker_expected_until(1) == std::chrono::steady_clock::time_point{});
  CHECK(arena->make_chunk(2, -1).ok());
  CHECK(store.released_.load() == released + 2);
  const auto parts = arena->writable_parts(0, size);
  CHECK(parts.size() == 1 && parts[0].first == 2 * range);
  CHECK(buffer.for_each_part(2 * range, range, [](char* host, size_t, size_t part) {
          memset(host, 0x72, part);
          return tmsl::Status::Ok();
        }).ok());
  CHECK(arena->pending_chunks().empty() && arena->content() == changed);
  arena->publish();
  CHECK(first_byte_of(2) == 0x72 && first_byte_of(0) == 0x50);
  std::vector<char> old_maker(1);
  CHECK(pread(files[2], old_maker.data(), 1, 0) == 1 && old_maker[0] == 0x22);  // never written here
  for (int fd : files) close(fd);
}

void host_copies_cache_goes_least_recently_used_first() {
  CopiesFixture f;
  auto older = f.arena(2), newer = f.arena(1), kept = f.arena(2);
  CHECK(older && newer && kept);
  if (!older || !newer || !kept) return;
  tmsl::HostCopies copies;
  copies.put(0x1000, CopiesFixture::buffer(older, 0), 0, tmsl::CopyState::kResident);
  copies.put(0x2000, CopiesFixture::buffer(older, 1), 0, tmsl::CopyState::kResident);
  copies.put(0x3000, CopiesFixture::buffer(newer, 0), 0, tmsl::CopyState::kResident);
  // An arena that also holds a paused allocation's copy is not cache.
  copies.put(0x4000, CopiesFixture::buffer(kept, 0), 0, tmsl::CopyState::kResident);
  copies.put(0x5000, CopiesFixture::buffer(kept, 1), 0, tmsl::CopyState::kPaused);
  newer->note_use();  // newer is used last; older first
  kept->note_use();
  older->note_use();
  newer->note_use();
  // Whole cached arenas: older and newer (kept holds a paused copy).
  CHECK(copies.cached_arena_bytes() == older->used_bytes() + newer->used_bytes());
  CHECK(copies.cached_arena_bytes({older.get()}) == newer->used_bytes());
  CHECK(copies.cached_bytes() == older->used_bytes() + newer->used_bytes() + kept->used_bytes());
  std::vector<tmsl::HostBuffer> taken = copies.take_cache(1);  // one arena is enough: the oldest
  CHECK(taken.size() == 2 && taken[0].arena == older && taken[1].arena == older);
  CHECK(copies.sizes().size() == 3);
  taken = copies.take_cache(SIZE_MAX);
  CHECK(taken.size() == 1 && taken[0].arena == newer);
  CHECK(copies.take_cache(SIZE_MAX).empty());  // the kept arena stays
  // A resume settling: a "pinned" copy stays (retained when asked), an "mmap" one goes at once.
  copies.note_state({0x4000, 0x5000}, tmsl::CopyState::kMoving);
  std::vector<tmsl::HostBuffer> let_go, free_now;
  copies.settle_resume({{0x4000, false, true}, {0x5000, true, false}}, 2, false, false, true, &let_go, &free_now);
  CHECK(let_go.empty() && free_now.size() == 1 && copies.sizes().size() == 1);
  bool has_copy = false;
  CHECK(!copies.lease(0x5000, false, &has_copy) && has_copy);  // resident and not retained: stale
}

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"backup_round_trip", backup_round_trip},
      {"large_backup_round_trips_in_parts_and_leases_whole", large_backup_round_trips_in_parts_and_leases_whole},
      {"no_backup_gets_fresh_zero_memory", no_backup_gets_fresh_zero_memory},
      {"free_while_paused_and_bad_frees", free_while_paused_and_bad_frees},
      {"out_of_memory_resume_rolls_back_and_retries", out_of_memory_resume_rolls_back_and_retries},
      {"injected_faults_keep_state_recoverable", injected_faults_keep_state_recoverable},
      {"retained_backups_are_reused_and_fresh", retained_backups_are_reused_and_fresh},
      {"hooks_route_by_thread_region", hooks_route_by_thread_region},
      {"destroyed_saver_handles_reach_nothing", destroyed_saver_handles_reach_nothing},
      {"null_out_pointers_are_refused", null_out_pointers_are_refused},
      {"destroy_races_with_pauses_and_foreign_frees", destroy_races_with_pauses_and_foreign_frees},
      {"threads_allocate_and_free_while_another_tag_cycles", threads_allocate_and_free_while_another_tag_cycles},
      {"cuda_backend_over_the_fake_driver", cuda_backend_over_the_fake_driver},
      {"disk_backup_round_trips_and_removes_its_files", disk_backup_round_trips_and_removes_its_files},
      {"failed_disk_write_leaves_everything_resident", failed_disk_write_leaves_everything_resident},
      {"disk_directory_on_host_memory_is_refused", disk_directory_on_host_memory_is_refused},
      {"content_arena_maps_held_chunks_and_copies_into_new_ones_only", content_arena_maps_held_chunks_and_copies_into_new_ones_only},
      {"content_arena_without_room_in_the_store_copies_into_private_memory",
       content_arena_without_room_in_the_store_copies_into_private_memory},
      {"changed_content_arena_is_recycled_only_where_every_changed_chunk_is_taken_back",
       changed_content_arena_is_recycled_only_where_every_changed_chunk_is_taken_back},
      {"replicas_changed_chunks_are_retired_then_adopted_in_place_or_replaced",
       replicas_changed_chunks_are_retired_then_adopted_in_place_or_replaced},
      {"host_copies_cache_goes_least_recently_used_first", host_copies_cache_goes_least_recently_used_first},
  };
  int passed = 0, failed = 0;
  for (const auto& test : tests) {
    int before = g_failures;
    test.second();
    bool ok = g_failures == before;
    printf("%s %s\n", ok ? "PASS" : "FAIL", test.first);
    (ok ? passed : failed)++;
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
