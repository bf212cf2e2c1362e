"""torch_mem_saver_lite standing in for torch_memory_saver (opt-in: torch_mem_saver_lite.alias)."""

from torch_mem_saver_lite.alias import check_import as _check_import

__torch_mem_saver_lite_alias__ = True

# ImportError where this would hide an installed torch_memory_saver unasked; a warning where an
# override (the .pth hook, TMSL_ALIAS_TORCH_MEMORY_SAVER=1, enable(override=True)) asked for it.
_check_import()

from torch_mem_saver_lite import configure_subprocess, torch_memory_saver  # noqa: E402
from torch_mem_saver_lite.alias import link_preload_library as _link_preload_library  # noqa: E402

_link_preload_library()  # for code that finds the preload library beside this package
from torch_mem_saver_lite.compat import TorchMemorySaver  # noqa: E402

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
