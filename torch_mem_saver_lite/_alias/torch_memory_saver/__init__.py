"""torch_mem_saver_lite standing in for torch_memory_saver (opt-in: torch_mem_saver_lite.alias)."""

from torch_mem_saver_lite.alias import real_installation as _real_installation

__torch_mem_saver_lite_alias__ = True

if _real_installation() is not None:
    raise ImportError(
        f"torch_mem_saver_lite's torch_memory_saver alias is on the path, but torch_memory_saver is "
        f"installed too ({_real_installation()}): uninstall it, or take the alias off PYTHONPATH"
    )

from torch_mem_saver_lite import configure_subprocess, torch_memory_saver  # noqa: E402
from torch_mem_saver_lite.compat import TorchMemorySaver  # noqa: E402

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
