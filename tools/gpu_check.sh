#!/usr/bin/env bash
# The whole GPU check in one call of at most 8 minutes (`LOG_DIR=logs bash tools/gpu_check.sh`):
#   1. tools/gpu_check.py: the Triton tests on CUDA, the sweep of tile configs (its choice, each config
#      checked to keep the contract, goes to $LOG_DIR/tuning.json), then the kernel timing table with it
#   2. the sampler's and the model families' CUDA tests (graph replay == eager == score, row
#      invariance), with the sweep's tile configs
#   3. tooling/bench.py --only gpu, with them: the rollout engine at Qwen3-30B-A3B layer shapes (tok/s,
#      bandwidth share, the fast path, the contract)
# Paste tuning.json into the tables (kernels_triton/ops.py, kernels_triton/moe.py; see kernels_triton/tuning.py)
# to keep what was measured. Logs go to $LOG_DIR (default out/gpu); each part has its own time limit,
# so one slow part cannot take the others' time. Extra arguments go to gpu_check.py.
set -o pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-out/gpu}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG_DIR/gpu.txt"
tuning="$LOG_DIR/tuning.json"
rm -f "$tuning"
# the limits add up to 470 s (on an empty Triton cache the first part also compiles every kernel);
# within gpu_check.py's 250 s: tests 90 (in processes of their own where pytest-xdist is installed;
# meanwhile three more processes compile the sweep's candidates), sweep 90 (mostly timing, then), the
# table the rest. Each part's exit status is printed (124: it ran out of time; 137: and was killed). At
# its limit a part gets SIGINT (pytest then still prints the failures so far; gpu_check.py stops its
# children), and SIGKILL 10 s later if it still runs, so the next part always starts (at most 500 s).
part() {   # part NAME LOG LIMIT COMMAND...: run it under its limit, log it, record its exit status
    local name=$1 log=$2 limit=$3
    shift 3
    timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$log"
    local status=${PIPESTATUS[0]}
    echo "gpu_check.sh: $name exit $status"
    [ "$status" -eq 0 ] || rc=1
}
part "gpu_check.py" gpu_check.log "${CHECK_TIMEOUT:-250}" python tools/gpu_check.py --test-timeout "${TEST_TIMEOUT:-90}" \
    --sweep-budget "${SWEEP_BUDGET:-90}" --tuning-out "$tuning" "$@"
tests_with=() bench_with=()
if [ -s "$tuning" ]; then
    tests_with=(--kernels-tuning "$tuning") bench_with=(--tuning "$tuning")
else
    echo "gpu_check.sh: no $tuning (the sweep did not finish): the tables as committed"
fi
xdist=()
python -c "import xdist" 2>/dev/null && xdist=(-n 4)
part "sampler and families CUDA tests" rollout_cuda.log "${ROLLOUT_TIMEOUT:-70}" \
    python -m pytest -q -rfEs "${xdist[@]}" tests/test_rollout.py tests/test_hf.py tests/test_memory.py tests/test_hybrids.py \
        -k cuda "${tests_with[@]}"
part "tooling/bench.py --only gpu" bench_gpu.log "${BENCH_TIMEOUT:-150}" python -m tooling.bench --only gpu "${bench_with[@]}"
echo "gpu_check.sh: exit $rc (logs in $LOG_DIR)"
exit $rc
