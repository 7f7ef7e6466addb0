#!/usr/bin/env bash
# Everything a GPU session checks, in one call (at most 9 min 20 s of limits; on the device machine:
# `LOG_DIR=$OUT bash tests/gpu_check.sh` with timeout_s 580, and the logs come back):
#   1. the sampler's and the model families' CUDA tests (graph replay == eager == score, row invariance)
#   2. tests/gpu_check.py: the Triton tests on CUDA, the kernel timing table, the tile-config sweep
#   3. bench.py --only gpu: the rollout engine at Qwen3-30B-A3B layer shapes (tok/s, bandwidth share)
# Logs go to $LOG_DIR (default out/gpu); each part has its own time limit, so one slow part cannot
# take the others' time. Extra arguments go to gpu_check.py.
set -o pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-${OUT:-out/gpu}}         # the device machine returns only what is under $OUT
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG_DIR/gpu.txt"
# the limits add up to 560 s (a fresh machine compiles every kernel first: the first part pays most)
timeout "${ROLLOUT_TIMEOUT:-120}" python -m pytest -q -rfEs tests/test_rollout.py tests/test_families.py -k cuda 2>&1 | tee "$LOG_DIR/rollout_cuda.log" || rc=1
timeout "${BENCH_TIMEOUT:-180}" python bench.py --only gpu 2>&1 | tee "$LOG_DIR/bench_gpu.log" || rc=1
timeout "${CHECK_TIMEOUT:-260}" python tests/gpu_check.py --test-timeout "${TEST_TIMEOUT:-120}" "$@" 2>&1 | tee "$LOG_DIR/gpu_check.log" || rc=1
echo "gpu_check.sh: exit $rc (logs in $LOG_DIR)"
exit $rc
