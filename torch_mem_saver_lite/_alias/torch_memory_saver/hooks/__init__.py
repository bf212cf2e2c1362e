"""The alias's ``torch_memory_saver.hooks`` package, laid out as torch_memory_saver's: some code
imports ``configure_subprocess`` from ``torch_memory_saver.hooks.mode_preload``."""

__torch_mem_saver_lite_alias__ = True
