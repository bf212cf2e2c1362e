#!/usr/bin/env bash
# The main job's evidence on a GPU machine, in one go (about 6 minutes on an H100):
# the default run, the same without the saver, two ranks with torchrun where there are two
# GPUs, then the example's GPU tests. Everything lands in the folder given as $1.
#   examples/gpu_check.sh out/h100          # SKIP_TESTS=1 leaves the tests out
set -u
out=${1:?usage: examples/gpu_check.sh OUTPUT_FOLDER}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
if ! $PYTHON -c "import torch_mem_saver_lite, matplotlib" 2>/dev/null; then make install > "$out/install.log" 2>&1; fi
[ -x .venv/bin/python ] && ! $PYTHON -c "import torch_mem_saver_lite" 2>/dev/null && PYTHON=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1

step() {  # step NAME COMMAND...: runs it, keeps its output and exit status and wall time
    local name=$1; shift
    local start=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/status.txt"
    tail -n 4 "$out/$name.log"
}

step default $PYTHON examples/rl_example.py --out "$out/default"
step no-saver $PYTHON examples/rl_example.py --no-saver --steps 2 --out "$out/no-saver"
if [ "$($PYTHON -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step torchrun-2 env NCCL_NVLS_ENABLE=0 $PYTHON -m torch.distributed.run --nproc-per-node 2 \
        examples/rl_example.py --steps 40 --out "$out/torchrun-2"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
    step gpu-tests $PYTHON -m pytest -q -p no:cacheprovider tests/examples/test_rl_example.py
fi
echo "results in $out: */summary.json, */memory.png, */reward.png, *.log, status.txt"
