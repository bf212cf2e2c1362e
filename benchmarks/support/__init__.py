"""Code the benchmarks, probes and GPU tests share: workload shapes, bare driver calls,
the stages of preparing host memory, and the C timing programs."""
