#!/usr/bin/env bash
# The GPU check for a lent H100 or H200, in one command that ends within 9 minutes (benchmarks/gpu_check.py):
#
#   bash scripts/gpu_check.sh                        # from the repository root, on the lent machine
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh    # on a CPU machine: the same logic, tiny shapes
#
# Uses the machine's own torch and lightning (installs nothing, needs no network), runs this
# checkout's code, and writes gpu_check.json (every phase, every figure against its target) and
# gpu_check.txt into $OUT when it is set (else the current folder). Pass --deadline-s N to change
# the 540 s deadline.
set -uo pipefail
cd "$(dirname "$0")/.."
# $PYTHON, else this checkout's venv (a CPU machine with scripts/setup_env.sh), else the machine's python.
PY="${PYTHON:-}"
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
[ -z "$PY" ] && { command -v python >/dev/null 2>&1 && PY=python || PY=python3; }
exec env PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m benchmarks.gpu_check --out "${OUT:-.}" "$@"
