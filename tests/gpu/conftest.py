"""GPU tests run in torch hook mode, or in preload mode when started by test_preload_mode.py
(TMSL_TEST_HOOK_MODE=preload with the library in LD_PRELOAD)."""

import os

import torch

from torch_mem_saver_lite import saver

if torch.cuda.is_available():
    saver.hook_mode = os.environ.get("TMSL_TEST_HOOK_MODE", "torch")
