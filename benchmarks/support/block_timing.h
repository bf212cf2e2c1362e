/* Timing shared by the C benchmarks: a monotonic clock in nanoseconds and the median of a
 * run of block times (it sorts them). */
#pragma once
#include <stdlib.h>
#include <time.h>

static inline double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static inline int compare_doubles(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static inline double median(double* v, int n) {
  qsort(v, n, sizeof(double), compare_doubles);
  return v[n / 2];
}
