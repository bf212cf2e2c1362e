/* Times cudaMalloc/cudaFree through the preloaded hook against the CUDA runtime's own
 * functions, in one process, for calls the hook only forwards (outside any region).
 * The saver holds live allocations meanwhile, so cudaFree's ownership lookup runs for real.
 *
 * usage: hook_overhead <path of libcudart> <iterations>   (run with the library in LD_PRELOAD) */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "block_timing.h"

typedef int (*malloc_fn)(void**, size_t);
typedef int (*free_fn)(void*);

/* Per-pair time of one block of malloc(size)+free, or of free(foreign) alone when
 * foreign != NULL (a pointer that is neither the saver's nor a valid allocation start:
 * the runtime rejects it at once, so the hook's ownership lookup is most of the time). */
static double block_ns(malloc_fn m, free_fn f, size_t size, void* foreign, int per_block) {
  double start = now_ns();
  for (int i = 0; i < per_block; ++i) {
    if (foreign) { f(foreign); continue; }
    void* p = NULL;
    if (m(&p, size) != 0) { fprintf(stderr, "cudaMalloc failed\n"); exit(2); }
    f(p);
  }
  return (now_ns() - start) / per_block;
}

/* Real and hooked blocks alternate, so drift cancels in the per-block differences. */
static void measure(const char* label, malloc_fn rm, free_fn rf, malloc_fn hm, free_fn hf,
                    size_t size, void* foreign, int blocks, int per_block) {
  double real[blocks], hooked[blocks], added[blocks];
  for (int b = 0; b < blocks; ++b) {
    real[b] = block_ns(rm, rf, size, foreign, per_block);
    hooked[b] = block_ns(hm, hf, size, foreign, per_block);
    added[b] = hooked[b] - real[b];
  }
  printf("%s %.1f %.1f %.1f\n", label, median(real, blocks), median(hooked, blocks), median(added, blocks));
}

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s libcudart iterations\n", argv[0]); return 2; }
  int iterations = atoi(argv[2]);
  void* runtime = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (!runtime) { fprintf(stderr, "%s\n", dlerror()); return 2; }
  malloc_fn real_malloc = (malloc_fn)dlsym(runtime, "cudaMalloc");
  free_fn real_free = (free_fn)dlsym(runtime, "cudaFree");
  malloc_fn hooked_malloc = (malloc_fn)dlsym(RTLD_DEFAULT, "cudaMalloc");
  free_fn hooked_free = (free_fn)dlsym(RTLD_DEFAULT, "cudaFree");
  int (*default_saver)(void**) = (int (*)(void**))dlsym(RTLD_DEFAULT, "tmsl_default_saver");
  int (*set_region)(void*, const char*, int) =
      (int (*)(void*, const char*, int))dlsym(RTLD_DEFAULT, "tmsl_set_thread_region");
  if (!default_saver || !set_region || hooked_malloc == real_malloc) {
    fprintf(stderr, "the library is not preloaded\n");
    return 2;
  }
  void* saver = NULL;
  void* held[64];
  if (default_saver(&saver) != 0) { fprintf(stderr, "no saver\n"); return 2; }
  set_region(saver, "bench", 0);
  for (int i = 0; i < 64; ++i) hooked_malloc(&held[i], 2 << 20);
  set_region(NULL, NULL, 0);

  block_ns(real_malloc, real_free, 2 << 20, NULL, 100); /* warm-up */
  void* device_block = NULL;
  real_malloc(&device_block, 4 << 20);
  int blocks = 101, per_block = iterations / 101 > 0 ? iterations / 101 : 1;
  measure("malloc+free_0_B", real_malloc, real_free, hooked_malloc, hooked_free, 0, NULL, blocks, per_block);
  measure("malloc+free_2_MiB", real_malloc, real_free, hooked_malloc, hooked_free, 2 << 20, NULL, blocks, per_block);
  measure("malloc+free_64_MiB", real_malloc, real_free, hooked_malloc, hooked_free, 64 << 20, NULL, blocks, per_block);
  measure("free_of_a_foreign_pointer", real_malloc, real_free, hooked_malloc, hooked_free, 0,
          (char*)device_block + 4096, blocks, per_block * 10);
  real_free(device_block);
  for (int i = 0; i < 64; ++i) hooked_free(held[i]);
  return 0;
}
