"""What a user needs to know about this machine before pausing GPU memory.

Facts about the driver and GPUs come from cuda-python (an observer independent of the
native library); the library's own state comes from the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    problems: list[str] = field(default_factory=list)


def _check(result):
    """cuda-python returns (CUresult, *values); raise on failure, return the values."""
    from cuda.bindings import driver

    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{error.name}")
    return values[0] if len(values) == 1 else values


def _driver_facts(env: Environment) -> None:
    try:
        from cuda.bindings import driver
    except ImportError:
        env.problems.append("cuda-python is not installed: pip install cuda-python")
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

    from . import _lib, saver

    env = Environment(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                      hook_mode=saver.hook_mode)
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
    return env


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
        f"native library:   {env.library_path or 'not found'}",
    ]
    if env.problems:
        lines.append("Missing for GPU use:")
        lines += [f"  - {problem}" for problem in env.problems]
    else:
        lines.append("Ready: regions can pause and resume GPU memory.")
    return "\n".join(lines)
