#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test extras; builds nothing.
# torch is installed first, exactly, as the CPU build these machines carry (pyproject.toml's range
# alone could pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0" "lightning==2.6.6"  # pyproject.toml has ranges; these machines, exact versions
# the build backend pyproject.toml names (the SPDX license string needs 77), in the venv itself: DeepSpeed's
# sdist below and tests/test_packaging.py's wheel build without isolation (torch 2.13 pulls it in, 2.11 does not)
python -m pip install -q "setuptools>=77"
# DeepSpeed (ZeRO) from its sdist: --no-build-isolation, or pip would build it against a fresh
# (CUDA) torch download in an isolated environment. Its C++ ops compile on first use.
python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
# transformers exactly too: the Hugging Face family tests are written against its models (on 5.17 GPT-J
# refuses sdpa, CodeGen splits its heads otherwise and several swept families do not exist yet)
python -m pip install -q "transformers==5.25.0"
python -m pip install -q -e ".[test]"
# torchao (8-bit optimizer states, fp8) in a side folder, not in the venv: transformers imports
# torchao in every process where it is importable (seconds each, noisy); the tests that need it
# put the folder on their path (tests/optional_packages.py). --no-deps: it must never touch torch.
[ -d .venv/extras/torchao ] || python -m pip install -q --no-deps --target .venv/extras "torchao==0.18.0"
# DeepSpeed's C++ ops (CPU Adam, shared-memory comm, async I/O, pinned memory) are NOT built here:
# the main job needs none of them. The test-suite builds them once before its first test
# (tests/conftest.py runs scripts/build_deepspeed_ops.py, minutes on a small machine), and a ZeRO
# offload job compiles the ones it needs on first use, saying so (docs/zero.md).
