#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test extras.
# torch is pinned (pyproject) to the CPU build these machines carry; an unpinned torch can
# pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
# DeepSpeed (ZeRO) from its sdist: --no-build-isolation, or pip would build it against a fresh
# (CUDA) torch download in an isolated environment. Its C++ ops compile on first use.
python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
python -m pip install -q -e ".[test]"
# torchao (8-bit optimizer states, fp8) in a side folder, not in the venv: transformers imports
# torchao in every process where it is importable (seconds each, noisy); the tests that need it
# put the folder on their path (tests/optional_packages.py). --no-deps: it must never touch torch.
[ -d .venv/extras/torchao ] || python -m pip install -q --no-deps --target .venv/extras "torchao==0.18.0"
# NVMe offload (ZeRO-Infinity) needs libaio's headers to build DeepSpeed's async I/O op.
if ! [ -e /usr/include/libaio.h ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q --no-install-recommends libaio-dev >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libaio-dev >/dev/null 2>&1; }) \
    || echo "setup_env: libaio-dev not installed; offload='nvme' will be unavailable" >&2
fi
# Build DeepSpeed's C++ ops once, into this venv's own cache, and check a second load finds
# nothing to do (scripts/build_deepspeed_ops.py says why both matter).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"
python scripts/build_deepspeed_ops.py
python scripts/build_deepspeed_ops.py --check
