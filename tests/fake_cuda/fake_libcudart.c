// A stand-in for libcudart.so.12 over tests/fake_cuda/fake_libcuda.c: the few runtime calls
// torch_memory_saver's libraries link, so that benchmarks/bench_core_overhead.py can run
// them beside torch_mem_saver_lite without a GPU. Built as libcudart.so.12 next to the fake
// libcuda.so.1, which it links.
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int cudaError_t;
void fake_cuda_make_current(int device);
int cuMemGetInfo(size_t* free_bytes, size_t* total);

static __thread int t_device;

EXPORT cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return 0;
}

EXPORT cudaError_t cudaSetDevice(int device) {
  t_device = device;
  fake_cuda_make_current(device);
  return 0;
}

EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  fake_cuda_make_current(t_device);
  return cuMemGetInfo(free_bytes, total) == 0 ? 0 : 1;
}

EXPORT cudaError_t cudaDeviceSynchronize(void) { return 0; }

EXPORT cudaError_t cudaMallocHost(void** ptr, size_t size) {
  *ptr = malloc(size);
  return *ptr != NULL ? 0 : 2;
}

EXPORT cudaError_t cudaFreeHost(void* ptr) {
  free(ptr);
  return 0;
}

EXPORT cudaError_t cudaMemcpy(void* dst, const void* src, size_t size, int kind) {
  (void)kind;
  memcpy(dst, src, size);
  return 0;
}

EXPORT const char* cudaGetErrorString(cudaError_t error) { return error == 0 ? "no error" : "fake runtime error"; }
