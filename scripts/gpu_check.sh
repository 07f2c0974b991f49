#!/usr/bin/env bash
# GPU check for a lent H200: GPT-1.3B step time, plain PyTorch vs Lightning vs HybridParallelStrategy vs compile.
#
#   bash scripts/gpu_check.sh            # from the repository root; about 4-6 minutes
#
# Uses the machine's preinstalled torch and lightning (installs nothing, needs no network), runs
# the code from this checkout with PYTHONPATH=. and writes everything it prints to
# $OUT/gpu_check.txt when $OUT is set (else ./gpu_check.txt), plus $OUT/gpu_step.json.
#
# Self-checking, in this order, stopping at the first failure (exit status != 0):
#   1. a CUDA device is visible to torch, and lightning + the project import;
#   2. `benchmarks.gpu_step --tiny --no-compile`: every phase's code path on the GPU in seconds
#      (a broken path fails here, before the 1.3B run spends minutes);
#   3. `benchmarks.gpu_step`: the measurement. It fails if a phase fails or if the phases do not
#      start from the same loss; a missed speed target is reported, not a failure.
# Time limits: 2 + 3 + 7 minutes at most (`timeout`), so a hang cannot eat the device budget.
#   4. `benchmarks.memory_savers --tiny`, then `--large`: activation bytes, peak memory and step time
#      of none / selective / full checkpointing / offload / bf16 and fp8 compression on GPT-1.3B
#      (bf16 autocast, batch 8 x 2048), and `--fp8`: a few steps with Float8Precision (torchao, if
#      the machine has it) against bf16-mixed. 3 + 7 + 3 minutes at most.
#      GPU_CHECK_ONLY=memory runs only this part (fits one lent-device session on its own).
#   5. `benchmarks.zero_offload`: ZeRO-2 + CPU offload vs on-GPU step time (GPT-1.3B), and the largest
#      GPT that trains with ZeRO-3 + CPU offload (if deepspeed is installed there).
#
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   # on a CPU machine: the script's own logic, with
#                                                   # `--tiny --cpu --no-compile` in steps 2 and 3
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
RESULTS_DIR="${OUT:-.}"
mkdir -p "$RESULTS_DIR"
LOG="$RESULTS_DIR/gpu_check.txt"
: > "$LOG"
PY="${PYTHON:-python}"
DRY="${GPU_CHECK_DRY_RUN:-}"
STEP_ARGS=()
[ -n "$DRY" ] && STEP_ARGS=(--tiny --cpu --no-compile)

say() { echo "$@" | tee -a "$LOG"; }
run() {  # run LIMIT_S CMD...: tee output into the log, keep the command's exit status
    local limit=$1; shift
    say "\$ $*"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | grep -v -E "Warning|warnings.warn|^ *$" | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
}
fail() { say "GPU CHECK FAILED: $*"; exit 1; }

say "# gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
say "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG" || true

run 120 "$PY" - <<'EOF' || fail "environment: no CUDA device, or lightning / the project does not import"
import torch, lightning
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, lightning {lightning.__version__}")
import os
if not os.environ.get("GPU_CHECK_DRY_RUN"):
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print(f"device: {torch.cuda.get_device_name(0)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
import lightning_parallel, recipes.gpt.module, benchmarks.gpu_step  # noqa: F401
print("imports ok")
EOF

if [ "${GPU_CHECK_ONLY:-}" != "memory" ]; then
run 180 "$PY" -m benchmarks.gpu_step --tiny --no-compile ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} || fail "the tiny run on the GPU (a code path is broken)"

run 420 "$PY" -m benchmarks.gpu_step --json "$RESULTS_DIR/gpu_step.json" ${STEP_ARGS[@]+"${STEP_ARGS[@]}"}
status=$?
[ "$status" -eq 124 ] && fail "the 1.3B run timed out after 420 s"
[ "$status" -ne 0 ] && fail "the 1.3B run exited with status $status"
grep -q "^RESULT strategy / eager" "$LOG" || fail "no RESULT line in the output"
fi

# Memory savers (docs/memory.md): every code path on the GPU in seconds, then the GPT-1.3B table.
MEMORY_ARGS=()
[ -n "$DRY" ] && MEMORY_ARGS=(--cpu)
run 180 "$PY" -m benchmarks.memory_savers --tiny ${MEMORY_ARGS[@]+"${MEMORY_ARGS[@]}"} || fail "memory savers: a code path is broken"
if [ -n "$DRY" ]; then
    run 420 "$PY" -m benchmarks.memory_savers --tiny --cpu --json "$RESULTS_DIR/memory_savers.json" || fail "memory savers table"
else
    run 420 "$PY" -m benchmarks.memory_savers --large --rounds 4 --json "$RESULTS_DIR/memory_savers.json"
    status=$?
    [ "$status" -eq 124 ] && fail "the 1.3B memory-savers run timed out after 420 s"
    [ "$status" -ne 0 ] && fail "the 1.3B memory-savers run exited with status $status"
fi
run 180 "$PY" -m benchmarks.memory_savers --fp8 || fail "the fp8 steps"

# ZeRO (docs/zero.md): GPT-1.3B bf16, ZeRO-2 with CPU offload against ZeRO-2 on the GPU (step-time
# ratio, target <= 2x), then the largest GPT that trains with ZeRO-3 + CPU offload (target >= 8B).
# Needs deepspeed on the machine (its CPU Adam compiles on first use, about a minute).
if "$PY" -c "import deepspeed" >/dev/null 2>&1; then
    ZERO_ARGS=()
    [ -n "$DRY" ] && ZERO_ARGS=(--tiny --cpu)
    run 300 "$PY" -m benchmarks.zero_offload --tiny ${ZERO_ARGS[@]+"${ZERO_ARGS[@]}"} || fail "ZeRO: a code path is broken"
    if [ -z "$DRY" ]; then
        run 420 "$PY" -m benchmarks.zero_offload --json "$RESULTS_DIR/zero_offload.json" || fail "the ZeRO offload ratio"
        run 540 "$PY" -m benchmarks.zero_offload --largest --limit-s 240 --json "$RESULTS_DIR/zero_largest.json" \
            || fail "the ZeRO-3 largest-model search"
    fi
else
    say "ZeRO part not run: deepspeed is not installed on this machine"
fi
say "GPU CHECK OK"
