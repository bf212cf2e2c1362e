/* What each tool's core adds to an allocation, a free, a pause and a resume over the driver
 * calls it makes, without a GPU: both run over the fake driver (tests/fake_cuda), whose own
 * cost (system calls) is the same for every path, and the same driver calls are also made
 * bare. Blocks of each path alternate; bench_core_overhead.py runs this plainly for times and
 * under callgrind for instruction counts (the functions named *_block, per call).
 * usage: core_overhead <fake libcuda> <libtorch_mem_saver_lite> <allocations> <blocks> [<tms torch hook>]
 * Prints the median time per allocation of each path over the blocks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "block_timing.h"

#define SIZE ((size_t)2 << 20)
#define BLOCK __attribute__((noinline))

typedef int (*proc_fn)(const char*, void**, int, unsigned long long, int*);

static struct {
  int (*init)(unsigned);
  int (*retain)(void**, int);
  int (*push)(void*);
  int (*reserve)(unsigned long long*, size_t, size_t, unsigned long long, unsigned long long);
  int (*create)(unsigned long long*, size_t, const void*, unsigned long long);
  int (*map)(unsigned long long, size_t, size_t, unsigned long long, unsigned long long);
  int (*access)(unsigned long long, size_t, const void*, size_t);
  int (*unmap)(unsigned long long, size_t);
  int (*release)(unsigned long long);
  int (*address_free)(unsigned long long, size_t);
} cu;

static struct {
  int (*default_saver)(void**);
  int (*set_thread_region)(void*, const char*, int);
  int (*pause)(void*, const char* const*, int, size_t*);
  int (*resume)(void*, const char* const*, int, size_t*, size_t*);
  void* (*torch_malloc)(long, int, void*);
  void (*torch_free)(void*, size_t, int, void*);
  int (*preload_malloc)(void**, size_t);
  int (*preload_free)(void*);
  void* saver;
} ours;

static struct {
  void (*set_region)(_Bool);
  void (*set_tag)(const char*);
  void (*set_backup)(_Bool);
  void* (*torch_malloc)(long, int, void*);
  void (*torch_free)(void*, long, int, void*);
  int (*pause)(const char*);
  int (*resume)(const char*);
} tms;

static const int kProp[8] = {1, 0, 1, 0};  /* CUmemAllocationProp: pinned, on device 0 */
static int g_failed;

static void* need(void* lib, const char* name) {
  void* fn = dlsym(lib, name);
  if (fn == NULL) {
    fprintf(stderr, "missing symbol %s\n", name);
    exit(2);
  }
  return fn;
}

/* An allocation (reserve, create, map, access) and its free (unmap, release, free the
 * range), n of each, as the driver's own calls. */
BLOCK static void bare_alloc_free_block(unsigned long long* va, unsigned long long* h, int n) {
  for (int i = 0; i < n; ++i) {
    g_failed |= cu.reserve(&va[i], SIZE, 0, 0, 0) | cu.create(&h[i], SIZE, kProp, 0) |
                cu.map(va[i], SIZE, 0, h[i], 0) | cu.access(va[i], SIZE, NULL, 1);
  }
  for (int i = 0; i < n; ++i) g_failed |= cu.unmap(va[i], SIZE) | cu.release(h[i]) | cu.address_free(va[i], SIZE);
}

/* A pause and resume without backup: unmap and release, then create, map and access. */
BLOCK static void bare_pause_resume_block(unsigned long long* va, unsigned long long* h, int n) {
  for (int i = 0; i < n; ++i) g_failed |= cu.unmap(va[i], SIZE) | cu.release(h[i]);
  for (int i = 0; i < n; ++i) {
    g_failed |= cu.create(&h[i], SIZE, kProp, 0) | cu.map(va[i], SIZE, 0, h[i], 0) | cu.access(va[i], SIZE, NULL, 1);
  }
}

BLOCK static void ours_torch_alloc_free_block(void** p, int n) {
  for (int i = 0; i < n; ++i) g_failed |= (p[i] = ours.torch_malloc((long)SIZE, 0, NULL)) == NULL;
  for (int i = 0; i < n; ++i) ours.torch_free(p[i], SIZE, 0, NULL);
}

BLOCK static void ours_preload_alloc_free_block(void** p, int n) {
  for (int i = 0; i < n; ++i) g_failed |= ours.preload_malloc(&p[i], SIZE);
  for (int i = 0; i < n; ++i) g_failed |= ours.preload_free(p[i]);
}

BLOCK static void ours_pause_resume_block(const char* tag) {
  g_failed |= ours.pause(ours.saver, &tag, 1, NULL) | ours.resume(ours.saver, &tag, 1, NULL, NULL);
}

BLOCK static void tms_torch_alloc_free_block(void** p, int n) {
  for (int i = 0; i < n; ++i) g_failed |= (p[i] = tms.torch_malloc((long)SIZE, 0, NULL)) == NULL;
  for (int i = 0; i < n; ++i) tms.torch_free(p[i], (long)SIZE, 0, NULL);
}

BLOCK static void tms_pause_resume_block(const char* tag) { g_failed |= tms.pause(tag) | tms.resume(tag); }

enum { kBareAlloc, kOursTorch, kOursPreload, kTmsTorch, kBareCycle, kOursCycle, kTmsCycle, kPaths };
static const char* kNames[kPaths] = {
    "bare driver calls: allocate + free", "ours, torch hook: allocate + free", "ours, preload hook: allocate + free",
    "torch_memory_saver, torch hook: allocate + free", "bare driver calls: pause + resume (no backup)",
    "ours: pause + resume (no backup)", "torch_memory_saver: pause + resume (no backup)"};

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr, "usage: %s <fake libcuda> <libtorch_mem_saver_lite> <allocations> <blocks> [<tms torch hook>]\n",
            argv[0]);
    return 2;
  }
  int n = atoi(argv[3]), blocks = atoi(argv[4]);
  int with_tms = argc == 6;
  setenv("TMSL_CUDA_DRIVER_LIBRARY", argv[1], 1);
  setenv("FAKE_CUDA_MEMORY_BYTES", "1099511627776", 1); /* 1 TiB: counted, never touched */
  void* fake = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);  /* the one instance every tool calls */
  void* lib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  void* other = with_tms ? dlopen(argv[5], RTLD_NOW | RTLD_LOCAL) : NULL;
  if (fake == NULL || lib == NULL || (with_tms && other == NULL)) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  proc_fn get = (proc_fn)need(fake, "cuGetProcAddress_v2");
  void** fields[] = {(void**)&cu.init, (void**)&cu.retain, (void**)&cu.push, (void**)&cu.reserve,
                     (void**)&cu.create, (void**)&cu.map, (void**)&cu.access, (void**)&cu.unmap,
                     (void**)&cu.release, (void**)&cu.address_free};
  const char* names[] = {"cuInit", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent", "cuMemAddressReserve",
                         "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
                         "cuMemAddressFree"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i) {
    int found = 0;
    if (get(names[i], fields[i], 12000, 0, &found) != 0) return 2;
  }
  cu.init(0);
  void* context = NULL;
  cu.retain(&context, 0);
  cu.push(context); /* current, as on torch's thread */

  *(void**)&ours.default_saver = need(lib, "tmsl_default_saver");
  *(void**)&ours.set_thread_region = need(lib, "tmsl_set_thread_region");
  *(void**)&ours.pause = need(lib, "tmsl_pause");
  *(void**)&ours.resume = need(lib, "tmsl_resume");
  *(void**)&ours.torch_malloc = need(lib, "tmsl_torch_malloc");
  *(void**)&ours.torch_free = need(lib, "tmsl_torch_free");
  *(void**)&ours.preload_malloc = need(lib, "cudaMalloc");
  *(void**)&ours.preload_free = need(lib, "cudaFree");
  if (ours.default_saver(&ours.saver) != 0 || ours.set_thread_region(ours.saver, "bench", 0) != 0) {
    fprintf(stderr, "torch_mem_saver_lite did not start over the fake driver\n");
    return 1;
  }
  if (with_tms) {
    *(void**)&tms.set_region = need(other, "tms_set_interesting_region");
    *(void**)&tms.set_tag = need(other, "tms_set_current_tag");
    *(void**)&tms.set_backup = need(other, "tms_set_enable_cpu_backup");
    *(void**)&tms.torch_malloc = need(other, "tms_torch_malloc");
    *(void**)&tms.torch_free = need(other, "tms_torch_free");
    *(void**)&tms.pause = need(other, "tms_pause");
    *(void**)&tms.resume = need(other, "tms_resume");
    tms.set_region(1);
    tms.set_tag("bench");
    tms.set_backup(0);
  }

  unsigned long long *va = calloc(n, sizeof(*va)), *h = calloc(n, sizeof(*h));
  unsigned long long *held_va = calloc(n, sizeof(*held_va)), *held_h = calloc(n, sizeof(*held_h));
  void **p = calloc(n, sizeof(*p)), **ours_held = calloc(n, sizeof(*p)), **tms_held = calloc(n, sizeof(*p));
  double* t[kPaths];
  for (int k = 0; k < kPaths; ++k) t[k] = calloc(blocks, sizeof(double));
  /* What each pause + resume works on: n allocations per tool, made once. */
  for (int i = 0; i < n; ++i) {
    g_failed |= cu.reserve(&held_va[i], SIZE, 0, 0, 0) | cu.create(&held_h[i], SIZE, kProp, 0) |
                cu.map(held_va[i], SIZE, 0, held_h[i], 0) | cu.access(held_va[i], SIZE, NULL, 1);
    g_failed |= (ours_held[i] = ours.torch_malloc((long)SIZE, 0, NULL)) == NULL;
    if (with_tms) g_failed |= (tms_held[i] = tms.torch_malloc((long)SIZE, 0, NULL)) == NULL;
  }
  for (int b = 0; b < blocks; ++b) {
    double t0 = now_ns();
    bare_alloc_free_block(va, h, n);
    double t1 = now_ns();
    ours_torch_alloc_free_block(p, n);
    double t2 = now_ns();
    ours_preload_alloc_free_block(p, n);
    double t3 = now_ns();
    if (with_tms) tms_torch_alloc_free_block(p, n);
    double t4 = now_ns();
    bare_pause_resume_block(held_va, held_h, n);
    double t5 = now_ns();
    ours_pause_resume_block("bench");
    double t6 = now_ns();
    if (with_tms) tms_pause_resume_block("bench");
    double t7 = now_ns();
    double at[kPaths] = {t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6};
    for (int k = 0; k < kPaths; ++k) t[k][b] = at[k] / n;
  }
  if (g_failed) {
    fprintf(stderr, "a call failed: the paths would not compare like with like\n");
    return 1;
  }
  printf("time per allocation of 2 MiB (%d allocations, median of %d blocks), ns:\n", n, blocks);
  for (int k = 0; k < kPaths; ++k) {
    if (with_tms || (k != kTmsTorch && k != kTmsCycle)) printf("  %-50s %8.0f\n", kNames[k], median(t[k], blocks));
  }
  return 0;
}
