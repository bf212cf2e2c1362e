"""What a user needs to know about this machine before pausing GPU memory.

Every fact about the driver and the GPUs comes from the native library itself (driver_info:
the libcuda it loads, the driver version, each GPU's virtual memory management support and
granularity), and the library's CUDA backend is started as a region would start it; torch
says what it sees. "Ready" is said only when all of these were confirmed. ``check()`` really
pauses and resumes a small region on each GPU.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field


@dataclass
class GpuInfo:
    index: int
    name: str
    vmm_supported: bool | None  # None: the driver could not say
    granularity_bytes: int | None
    total_bytes: int | None = None


@dataclass
class Environment:
    driver_version: str | None = None  # "12.8": the CUDA version the driver supports
    driver_library: str | None = None  # the libcuda file the native library loaded
    gpus: list[GpuInfo] = field(default_factory=list)
    cuda_backend: str = "not started"  # "ready" once the native CUDA backend started
    torch_version: str = ""
    torch_cuda: str | None = None
    torch_sees_gpu: bool = False
    library_path: str | None = None
    hook_mode: str = ""
    version: str = ""
    memory: list[dict] = field(default_factory=list)  # per GPU: what holds device memory
    host_memory: dict = field(default_factory=dict)  # the node's host-memory budget (saver.host_memory())
    breakdown: list[dict] = field(default_factory=list)  # per GPU: saver.memory_breakdown(), as a dict
    # TMSL_LIKE_TORCH_MEMORY_SAVER=1 (as the library read it), and where so, the five settings it
    # changes as the saver has them now (an explicit setting may have won): host_cache_bytes,
    # verify_wake, stray_access (the budget and sharing are in host_memory)
    like_torch_memory_saver: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _like_torch_memory_saver() -> dict:
    """The saver's settings the switch changes, where TMSL_LIKE_TORCH_MEMORY_SAVER=1; {} otherwise
    (or where the environment has a bad value, which the saver raises at first use)."""
    from . import saver
    from .errors import MemorySaverError

    try:
        if not saver._settings.environment().like_torch_memory_saver:
            return {}
        return dict(host_cache_bytes=saver.host_cache_bytes, verify_wake=saver.verify_wake,
                    stray_access=saver.stray_access)
    except MemorySaverError:
        return {}


def _no_gpu_hint() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible!r} hides GPUs)" if visible is not None else ""


def _driver_facts(env: Environment) -> bool:
    """The driver and GPUs as the native library reports them; whether all is usable."""
    from . import driver_info

    try:
        facts = driver_info.query()
    except Exception as error:  # a library without the query (TMSL_LIBRARY): report, do not raise
        env.problems.append(f"the native library cannot query the CUDA driver: {error}")
        return False
    before = len(env.problems)
    env.driver_version, env.driver_library = facts.version_text, facts.path
    for d in facts.devices:
        env.gpus.append(GpuInfo(d.index, d.name, d.vmm_supported, d.granularity_bytes, d.total_bytes))
    if not facts.loaded:
        env.problems.append(f"no CUDA driver: {facts.error}; install the NVIDIA driver or run on a GPU machine")
        return False
    if facts.error:
        env.problems.append(f"the CUDA driver ({facts.path}) is not usable: {facts.error}")
        return False
    if not facts.devices:
        env.problems.append(f"the CUDA driver sees no GPU{_no_gpu_hint()}")
    for d in facts.devices:
        if d.error:
            env.problems.append(f"GPU {d.index} ({d.name or 'no name'}) could not be queried: {d.error}")
        elif not d.vmm_supported:
            env.problems.append(f"GPU {d.index} ({d.name}) does not support CUDA virtual memory management")
    return len(env.problems) == before


def _start_backend(env: Environment) -> None:
    """Start the native CUDA backend as the first region would (every driver entry point it
    needs resolved, cuInit, the device count), so "ready" is the library's own answer."""
    from . import _lib

    try:
        _lib.NativeSaver.process_wide()
        env.cuda_backend = "ready"
    except Exception as error:  # a diagnosis: report, do not raise
        env.cuda_backend = f"failed: {error}"
        env.problems.append(f"the CUDA backend cannot start: {error}")


def _torch_facts(env: Environment) -> None:
    import torch

    env.torch_sees_gpu = torch.cuda.is_available()
    if env.torch_cuda is None:
        env.problems.append(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
    elif env.gpus and not env.torch_sees_gpu:
        # A driver older than torch's CUDA major is the usual cause: say so where it is.
        older = env.driver_version is not None and _major(env.torch_cuda) > _major(env.driver_version)
        needs = f": torch is built for CUDA {env.torch_cuda}, the driver supports {env.driver_version}" if older else ""
        env.problems.append(f"torch cannot use the GPU (torch.cuda.is_available() is False){needs}")


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdecimal() else 0


def collect() -> Environment:
    """Gather the environment; never raises, lists what is missing in ``problems``."""
    import torch

    from . import __version__, _lib, saver

    env = Environment(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                      hook_mode=saver.hook_mode, version=__version__)
    try:
        env.library_path = _lib.library_path()
        _lib.lib()
    except Exception as error:
        env.problems.append(f"native library unusable: {error}")
    else:
        if _driver_facts(env):
            _start_backend(env)
    _torch_facts(env)
    try:
        env.host_memory = asdict(saver.host_memory())
    except Exception as error:
        env.problems.append(f"the node's host-memory ledger cannot be read: {error}")
    env.like_torch_memory_saver = _like_torch_memory_saver()
    if env.torch_sees_gpu:
        env.memory = memory_use()
        env.breakdown = memory_breakdowns(env.problems)
    return env


def memory_breakdowns(problems: list[str]) -> list[dict]:
    """saver.memory_breakdown() of every GPU, as dicts (a failure is listed in ``problems``)."""
    import torch

    from . import saver

    rows = []
    for index in range(torch.cuda.device_count()):
        try:
            rows.append(saver.memory_breakdown(index).as_dict())
        except Exception as error:  # a diagnosis: report, do not raise
            problems.append(f"memory breakdown of GPU {index} failed: {error}")
    return rows


def memory_use() -> list[dict]:
    """Per GPU, what holds device memory: the saver's tags (resident and paused), torch's
    caching allocator, and the rest (CUDA context and modules, NCCL, other libraries)."""
    import torch

    from . import saver

    stats = saver.stats()
    resident = sum(s.resident_bytes for s in stats.values())
    paused = sum(s.paused_bytes for s in stats.values())
    rows = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        used, reserved = total - free, torch.cuda.memory_reserved(index)
        # In torch hook mode the saver's segments sit in torch's pools and count as reserved.
        rows.append(dict(device=index, total_bytes=total, used_bytes=used, torch_reserved_bytes=reserved,
                         saver_resident_bytes=resident, saver_paused_bytes=paused,
                         other_bytes=max(0, used - max(reserved, resident))))
    return rows


def check(nbytes: int = 64 << 20) -> list[dict]:
    """On each GPU: allocate ``nbytes`` in a backed-up region, pause it, see the device's
    free memory rise by it, resume and compare every byte. One result per GPU."""
    import torch

    from . import saver

    results = []
    for index in range(torch.cuda.device_count()):
        tag = f"doctor-check-{index}"
        try:
            with torch.cuda.device(index):
                with saver.region(tag, enable_cpu_backup=True):
                    data = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                data.copy_(torch.arange(nbytes, device="cuda", dtype=torch.int64).remainder(251).to(torch.uint8))
                expected = data.clone()
                torch.cuda.synchronize()
                free_before = torch.cuda.mem_get_info(index)[0]
                saver.pause(tag)
                released = torch.cuda.mem_get_info(index)[0] - free_before
                saver.resume(tag)
                intact = bool(torch.equal(data, expected))
                del data, expected
                saver.empty_cache(tag)
            ok = released >= 0.99 * nbytes and intact
            reason = "" if ok else (f"pausing released {released} of {nbytes} bytes" if released < 0.99 * nbytes
                                    else "content changed across pause and resume")
        except Exception as error:  # report it: this is a diagnosis, not a test run
            ok, released, reason = False, 0, f"{type(error).__name__}: {error}"
        results.append(dict(device=index, passed=ok, released_bytes=released, reason=reason))
    return results


def render(env: Environment) -> str:
    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / (1 << 20):.0f} MiB"

    def yes(flag: bool | None) -> str:
        return "unknown" if flag is None else "yes" if flag else "NO"

    driver = f"{env.driver_version or 'version unknown'} ({env.driver_library})" if env.driver_library \
        else "not loaded"
    lines = [
        f"CUDA driver:      {driver}",
        f"GPUs:             {len(env.gpus)}",
    ]
    for gpu in env.gpus:
        lines.append(f"  [{gpu.index}] {gpu.name}: {mib(gpu.total_bytes)}, virtual memory management "
                     f"{yes(gpu.vmm_supported)}, granularity {mib(gpu.granularity_bytes)}")
    lines += [
        f"CUDA backend:     {env.cuda_backend}",
        f"torch:            {env.torch_version} (CUDA {env.torch_cuda or 'none'}), "
        f"sees a GPU: {'yes' if env.torch_sees_gpu else 'no'}",
        f"hook mode:        {env.hook_mode}",
        f"native library:   {env.library_path or 'not found'} (torch_mem_saver_lite {env.version})",
    ]
    host = env.host_memory
    if host:
        lines.append(f"host memory:      {host['error']}" if host["error"] else
                     f"host memory:      budget {mib(host['budget_bytes'])} for the node ({host['ledger']}); held: "
                     f"this process {mib(host['held_by_this_process'])}, others {mib(host['held_by_others'])} "
                     f"({len([h for h in host['holders'] if not h['this_process']])} processes)")
        # (The doctor is a process of its own: alone, it says what a process that is not would do.)
        lines.append(f"shared backups:   yes, identical backups are held once per node in {host['store']}"
                     if host["backups_shared"] else
                     f"shared backups:   yes, where another process of the node uses the library (a process alone "
                     f"copies privately; TMSL_SHARE_BACKUPS=1 shares anyway): identical backups are held once per node "
                     f"in {host['store']}" if host.get("alone") else
                     f"shared backups:   no: {host['sharing_off_reason']}")
        if not host["error"]:
            sharers = [h for h in host["holders"] if h.get("shared_bytes")]
            lines.append(f"held once:        {mib(host['shared_bytes'])} of distinct backups in the node's store, "
                         f"mapped by {len(sharers)} processes"
                         + ("" if not sharers else " (" + ", ".join(
                             f"pid {h['pid']}{' (this one)' if h['this_process'] else ''}: {mib(h['shared_bytes'])}"
                             for h in sharers) + ")"))
            lines.append(f"disk tier:        {host['disk_tier']} (what the budget cannot hold goes there)"
                         if host["disk_tier"] else
                         f"disk tier:        none ({host['disk_tier_problem']}; a pause beyond the budget is refused)"
                         if host["disk_tier_problem"] else
                         "disk tier:        none (a pause beyond the budget is refused; set TMSL_DISK_BACKUP_DIR "
                         "to a directory on a real disk to send it to disk)")
    like = env.like_torch_memory_saver
    if like:
        # Each of the five as the saver has it: the switch's value, or ours where a setting of its own won.
        budget = host.get("budget_bytes", 0) if host else 0
        lines.append("behaving like torch_memory_saver (TMSL_LIKE_TORCH_MEMORY_SAVER=1): " + ", ".join([
            "no host cache after a resume" if like["host_cache_bytes"] == 0 else
            f"host cache {mib(like['host_cache_bytes'])} (set explicitly)",
            "no host-memory budget" if budget == 0 else f"host-memory budget {mib(budget)} (set explicitly)",
            "no shared backups" if not (host and host["backups_shared"]) else "shared backups (set explicitly)",
            "no wake check" if not like["verify_wake"] else "wake checks on (set explicitly)",
            "stray access off" if like["stray_access"] == "off" else
            f"stray access {like['stray_access']} (set explicitly)"]))
    for m in env.memory:
        lines.append(f"  GPU {m['device']} memory: {mib(m['used_bytes'])} used of {mib(m['total_bytes'])}: "
                     f"torch reserved {mib(m['torch_reserved_bytes'])}, saver resident "
                     f"{mib(m['saver_resident_bytes'])} (paused {mib(m['saver_paused_bytes'])}), "
                     f"other (context, NCCL, libraries) {mib(m['other_bytes'])}")
    for b in env.breakdown:
        lines.append(f"  GPU {b['device']} breakdown: context {mib(b['cuda_context'])}, torch outside regions "
                     f"{mib(b['torch_reserved_outside_regions'])}, NCCL {mib(b['nccl'])} (suspended "
                     f"{mib(b['nccl_suspended'])}), saver resident {mib(b['saver_resident'])}, stray-access "
                     f"scratch {mib(b['saver_scratch'])}, unknown "
                     f"{mib(b['unknown'])}; saver paused {mib(b['saver_paused'])}")
        lines += [f"    note: {note}" for note in b["notes"]]
    if env.problems:
        lines.append("Missing for GPU use:")
        lines += [f"  - {problem}" for problem in env.problems]
    else:
        lines.append("Ready: regions can pause and resume GPU memory.")
    return "\n".join(lines)
