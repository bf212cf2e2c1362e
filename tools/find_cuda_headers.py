"""Print the include directory of a pip-installed NVIDIA package that ships cuda.h.

CMake runs this to build without a CUDA toolkit: nvidia-cuda-runtime-cu12 installs
nvidia/cuda_runtime/include/cuda.h (CUDA 13's packages use nvidia/cu13/include). Exits 1
when no such package is installed.
"""

import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations or []) if spec is not None else []
headers = sorted(h for root in roots for h in pathlib.Path(root).glob("*/include/cuda.h"))
if not headers:
    sys.exit(1)
print(headers[0].parent)
