"""Every test file, classified once, by one criterion: what kind of promise it checks. The
folder a file is in is its class (tests/<level>/test_*.py), and nothing else says it:

- contract: the interfaces as written down (C ABI, Python API and its errors, the
  torch_memory_saver drop-in, the package, the documentation).
- features: one feature's behaviour, on the host backend, the stand-in driver or a GPU.
- robustness: what must hold when things go wrong or run at once (faults, fork, SIGKILL,
  Ctrl-C, out of memory, races, threads, random sequences, soaks).
- examples: the RL example, the main job.

WHAT says what each file checks, by its name (names are unique across the folders: pytest
imports each file as a top-level module). tests/contract/test_manifest.py checks that every
test file is in a level's folder and that WHAT names exactly the files there.
"""

from __future__ import annotations

LEVELS = ("contract", "features", "robustness", "examples")

WHAT: dict[str, str] = {
    "test_abi.py": "the headers, the ctypes table, the exported symbols and the status codes agree",
    "test_alias_routes.py": "the routes that make `import torch_memory_saver` load us",
    "test_api.py": "argument checks, errors, the process-wide saver, the C ABI's answers to bad input",
    "test_backup_memory.py": "CPU backups' content and host memory, on every backend",
    "test_cuda_backend_fake_driver.py": "the CUDA backend over the stand-in driver",
    "test_cuda_graphs.py": "pauseable graph pools, nested regions, disable(), expandable segments (GPU)",
    "test_cuda_hardening.py": "capture, failed resumes and the GPU soak (GPU)",
    "test_docs.py": "the documentation agrees with the code and with itself",
    "test_doctor.py": "the doctor's facts and verdict",
    "test_drop_in.py": "torch_memory_saver's signatures and behaviour; its programs, unmodified, on a GPU",
    "test_environment.py": "every TMSL_*/TMS_* variable: one grammar per kind, refused by name at first use",
    "test_fingerprint.py": "the content fingerprint: its CPU half against the definition, its PTX",
    "test_fingerprint_gpu.py": "the GPU fingerprint gives what the CPU half gives, bit for bit (GPU)",
    "test_fork.py": "a forked child refuses saver calls, never hangs (host and GPU)",
    "test_graph_memory.py": "graph memory backed up by default; poison on resume",
    "test_host_bad_input.py": "integers, encodings and paths range-checked before they reach C",
    "test_host_disk_backup.py": "disk backup",
    "test_host_disk_backup_fork_and_kill.py": "disk backup's files after a fork and a SIGKILL",
    "test_host_faults.py": "failure atomicity under injected driver errors",
    "test_host_hooks.py": "tag hooks tied to the real transitions",
    "test_host_memory_budget.py": "one host-memory budget for the node's processes, never exceeded",
    "test_host_memory_budget_races.py": "the node's budget kept by processes forking, racing, killed with SIGKILL",
    "test_host_memory_limit.py": "the host cache's default budget from the memory this process may use",
    "test_host_memory_pool.py": "host memory as a pool any pause takes; background host work gives way",
    "test_host_options.py": "disable(), memory_margin_bytes, retain_cpu_backup",
    "test_host_out_of_memory.py": "out of memory loses nothing paused",
    "test_host_pieces.py": "large backed-up allocations resumed in pieces",
    "test_host_prepared_backups.py": "host memory set aside ahead of the first pause",
    "test_host_properties.py": "random sequences checked against a model",
    "test_host_races.py": "calls racing each other",
    "test_host_seam.py": "the core's tag rules hold for allocations Python routes",
    "test_host_shared_backups.py": "identical backups stored once per node (TMSL_SHARE_BACKUPS)",
    "test_host_shared_backups_fork_and_kill.py": "holders of shared backups forking or killed, at random points too",
    "test_host_soak.py": "1,000 cycles without growth",
    "test_host_threads.py": "threads allocating while another tag cycles, pausing tags with hooks at once",
    "test_install.py": "the wheel built, installed in a fresh venv, used and uninstalled (slow)",
    "test_interrupts.py": "Ctrl-C at any line; a real SIGINT during an 8 GiB pause on a GPU",
    "test_layout.py": "csrc/ drawn from its includes: no circle, no upward arrow",
    "test_leftovers.py": "release_leftovers / restore_leftovers, memory_breakdown, NCCL groups",
    "test_like_torch_memory_saver.py": "TMSL_LIKE_TORCH_MEMORY_SAVER=1: behave like torch_memory_saver",
    "test_manifest.py": "this classification agrees with the files on disk",
    "test_multi_gpu.py": "several GPUs and NCCL processes (GPU)",
    "test_package.py": "what an installed package shows: version, typing, license, logging",
    "test_pause_path.py": "what a pause and a resume cost in Python: 2 native calls, at most 5 frames down",
    "test_pause_resume.py": "pause/resume semantics, on every backend",
    "test_paused_guard.py": "saver.guard(): an op on paused memory raises before it runs",
    "test_plots.py": "the pictures: the RL example's memory and reward plots, the side-by-side chart",
    "test_preload.py": "preload mode's cudaMalloc/cudaFree; every GPU test again under LD_PRELOAD",
    "test_rl_example.py": "the RL example's promises on a GPU",
    "test_rl_example_cpu.py": "the RL example's pieces on the CPU",
    "test_soft_pause.py": "paused memory with a host backup mapped to its copy: readable, writable while paused",
    "test_stray_access.py": "paused memory without a backup harmless to touch, stray writes reported",
    "test_wake_checks.py": "verified wakes and each tag's status, on every backend",
}

