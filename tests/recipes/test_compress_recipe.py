"""``python -m recipes.gpt.compress all`` runs the three recipes in one command and prints what they compare.

Two CPU processes through Lightning's own launcher (tp=2 for distillation and pruning, dp=2 for QAT),
a few steps each: the numbers are not judged here (tests/compression/test_quality.py asserts what
each technique gains), only that every comparison ran to the end and printed finite losses.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.environment import ROOT, worker_environment
from tests.optional_packages import EXTRAS

NUMBER = r"(\d+\.\d+|nan)"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_every_compression_recipe_runs_in_one_command() -> None:
    env = (
        worker_environment()
    )  # torchao from the venv's side folder (tests/optional_packages.py), as a user's install has it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXTRAS), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-m", "recipes.gpt.compress", "all", "--steps", "6"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=280)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    distil = re.search(rf"distil: teacher val_loss {NUMBER}; student alone {NUMBER}, distilled {NUMBER}", out)
    qat = re.search(
        rf"qat 8da4w: float {NUMBER} .*PTQ {NUMBER}; QAT fake-quantised {NUMBER}, converted {NUMBER}", out
    )
    prune = re.search(rf"prune 50% \((\d+) of (\d+) weights\): dense {NUMBER}, pruned {NUMBER}", out)
    assert distil and qat and prune, out[-3000:]
    assert all(math.isfinite(float(x)) for x in [*distil.groups(), *qat.groups(), *prune.groups()[2:]])
    assert int(prune[1]) * 2 == int(prune[2])
