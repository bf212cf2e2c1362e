"""What a user needs to know about this machine before pausing GPU memory.

Facts about the driver and GPUs come from cuda-python when it is installed (an observer
independent of the native library), else from torch; the library's own state comes from
the package. ``check()`` really pauses and resumes a small region on each GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GpuInfo:
    index: int
    name: str
    vmm_supported: bool
    granularity_bytes: int | None


@dataclass
class Environment:
    driver_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    torch_version: str = ""
    torch_cuda: str | None = None
    torch_sees_gpu: bool = False
    library_path: str | None = None
    hook_mode: str = ""
    version: str = ""
    memory: list[dict] = field(default_factory=list)  # per GPU: what holds device memory
    breakdown: list[dict] = field(default_factory=list)  # per GPU: saver.memory_breakdown(), as a dict
    problems: list[str] = field(default_factory=list)


def _check(result: tuple[Any, ...]) -> Any:
    """cuda-python returns (CUresult, *values); raise on failure, return the values."""
    from cuda.bindings import driver

    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{error.name}")
    return values[0] if len(values) == 1 else values


def _torch_facts(env: Environment) -> None:
    """GPU names from torch, where cuda-python is not installed."""
    import torch

    if torch.cuda.is_available():
        env.gpus = [GpuInfo(i, torch.cuda.get_device_name(i), True, None) for i in range(torch.cuda.device_count())]


def _driver_facts(env: Environment) -> None:
    try:
        from cuda.bindings import driver
    except ImportError:
        _torch_facts(env)  # the check below still tries a real map/unmap
        return
    try:
        _check(driver.cuInit(0))
    except Exception as error:  # no libcuda, no device, broken install
        env.problems.append(f"no usable CUDA driver: {error}")
        return
    version = _check(driver.cuDriverGetVersion())
    env.driver_version = f"{version // 1000}.{version % 1000 // 10}"
    for index in range(_check(driver.cuDeviceGetCount())):
        device = _check(driver.cuDeviceGet(index))
        name = _check(driver.cuDeviceGetName(128, device)).split(b"\0", 1)[0].decode()
        vmm = bool(_check(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device)))
        granularity = None
        if vmm:
            prop = driver.CUmemAllocationProp()
            prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = index
            granularity = _check(driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        else:
            env.problems.append(f"GPU {index} ({name}) does not support CUDA virtual memory management")
        env.gpus.append(GpuInfo(index, name, vmm, granularity))
    if not env.gpus:
        env.problems.append("the CUDA driver sees no GPU")


def collect() -> Environment:
    """Gather the environment; never raises, lists what is missing in ``problems``."""
    import torch

    from . import __version__, _lib, saver

    env = Environment(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                      hook_mode=saver.hook_mode, version=__version__)
    _driver_facts(env)
    env.torch_sees_gpu = torch.cuda.is_available()
    if env.torch_cuda is None:
        env.problems.append(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
    elif env.gpus and not env.torch_sees_gpu:
        env.problems.append("torch cannot use the GPU (torch.cuda.is_available() is False)")
    try:
        env.library_path = _lib.library_path()
        _lib.lib()
    except Exception as error:
        env.problems.append(f"native library unusable: {error}")
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

    lines = [
        f"CUDA driver:      {env.driver_version or 'not found'}",
        f"GPUs:             {len(env.gpus)}",
    ]
    for gpu in env.gpus:
        lines.append(f"  [{gpu.index}] {gpu.name}: virtual memory management "
                     f"{'yes' if gpu.vmm_supported else 'NO'}, granularity {mib(gpu.granularity_bytes)}")
    lines += [
        f"torch:            {env.torch_version} (CUDA {env.torch_cuda or 'none'}), "
        f"sees a GPU: {'yes' if env.torch_sees_gpu else 'no'}",
        f"hook mode:        {env.hook_mode}",
        f"native library:   {env.library_path or 'not found'} (torch_mem_saver_lite {env.version})",
    ]
    for m in env.memory:
        lines.append(f"  GPU {m['device']} memory: {mib(m['used_bytes'])} used of {mib(m['total_bytes'])}: "
                     f"torch reserved {mib(m['torch_reserved_bytes'])}, saver resident "
                     f"{mib(m['saver_resident_bytes'])} (paused {mib(m['saver_paused_bytes'])}), "
                     f"other (context, NCCL, libraries) {mib(m['other_bytes'])}")
    for b in env.breakdown:
        lines.append(f"  GPU {b['device']} breakdown: context {mib(b['cuda_context'])}, torch outside regions "
                     f"{mib(b['torch_reserved_outside_regions'])}, NCCL {mib(b['nccl'])} (suspended "
                     f"{mib(b['nccl_suspended'])}), saver resident {mib(b['saver_resident'])}, unknown "
                     f"{mib(b['unknown'])}; saver paused {mib(b['saver_paused'])}")
        lines += [f"    note: {note}" for note in b["notes"]]
    if env.problems:
        lines.append("Missing for GPU use:")
        lines += [f"  - {problem}" for problem in env.problems]
    else:
        lines.append("Ready: regions can pause and resume GPU memory.")
    return "\n".join(lines)
