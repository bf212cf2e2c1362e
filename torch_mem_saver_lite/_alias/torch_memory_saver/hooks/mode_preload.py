"""torch_memory_saver.hooks.mode_preload: configure_subprocess, where some code imports it."""

from torch_mem_saver_lite import configure_subprocess

__torch_mem_saver_lite_alias__ = True
__all__ = ["configure_subprocess"]
