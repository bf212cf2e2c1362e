"""torch_memory_saver.utils as frameworks use it: where the preload library is."""

from pathlib import Path

from torch_mem_saver_lite import _lib

__torch_mem_saver_lite_alias__ = True

_STEMS = ("torch_memory_saver_hook_mode_preload", "torch_memory_saver_hook_mode_torch")


def get_binary_path_from_package(stem: str) -> Path:
    """torch_mem_saver_lite's one library serves both hook modes and every CUDA major."""
    if stem not in _STEMS:
        raise RuntimeError(f"torch_memory_saver: no binary named {stem!r}; known: {', '.join(_STEMS)}")
    return Path(_lib.library_path())
