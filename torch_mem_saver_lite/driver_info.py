"""What the CUDA driver reports, as the native library sees it through its one loader of the
driver: the library it loaded and from where, the driver version, and per GPU its name, memory,
virtual memory management support and allocation granularity (``tmsl_driver_info_json``); the
devices this process holds a context on (``tmsl_devices_with_context``). Asking creates no
CUDA context.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from typing import Any

from . import _lib

# The ctypes signatures of the functions this module binds (csrc/api/c_api.h; test_abi.py checks them).
SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "tmsl_driver_info_json": ([ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
    "tmsl_devices_with_context": ([ctypes.POINTER(ctypes.c_int), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
                                  ctypes.c_int),
}


def _bound(name: str) -> Any:
    function = getattr(_lib.lib(), name)
    function.argtypes, function.restype = SIGNATURES[name]
    return function


@dataclass(frozen=True)
class DeviceFacts:
    index: int
    name: str
    total_bytes: int | None
    vmm_supported: bool | None  # None: the driver could not say (see ``error``)
    granularity_bytes: int | None  # known where virtual memory management is supported
    error: str  # "" when every query of this device succeeded


@dataclass(frozen=True)
class DriverFacts:
    requested: str  # what the library asked the dynamic loader for
    loaded: bool
    path: str | None  # the file that was loaded
    version: int | None  # cuDriverGetVersion: 12080 is CUDA 12.8
    error: str  # "" when the driver loaded, initialised and listed its devices
    devices: tuple[DeviceFacts, ...]

    @property
    def version_text(self) -> str | None:
        """The driver's CUDA version as "12.8" (None: not known)."""
        return None if self.version is None else f"{self.version // 1000}.{self.version % 1000 // 10}"


def query() -> DriverFacts:
    """Ask the native library what the driver reports now (MemorySaverError if the library
    itself cannot be loaded; a missing driver is a fact in the answer, not an error)."""
    function = _bound("tmsl_driver_info_json")
    length, capacity = ctypes.c_size_t(), 4096
    while True:
        buffer = ctypes.create_string_buffer(capacity)
        _lib.check(function(buffer, capacity, ctypes.byref(length)))
        if length.value < capacity:
            break
        capacity = length.value + 1
    raw = json.loads(buffer.value.decode(errors="replace"))
    devices = tuple(DeviceFacts(d["index"], d["name"], d["total_bytes"], d["vmm"], d["granularity"], d["error"])
                    for d in raw["devices"])
    return DriverFacts(raw["requested"], raw["loaded"], raw["path"], raw["version"], raw["error"], devices)


def devices_with_context() -> list[int]:
    """The devices this process holds a primary CUDA context on (asking makes none);
    DriverNotFoundError without a usable driver."""
    function, count, capacity = _bound("tmsl_devices_with_context"), ctypes.c_size_t(), 16
    while True:
        out = (ctypes.c_int * capacity)()
        _lib.check(function(out, capacity, ctypes.byref(count)))
        if count.value <= capacity:
            return list(out[:count.value])
        capacity = count.value
