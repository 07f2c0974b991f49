"""fp8 training follows the one-process fp8 run within its measured tolerance, and a wrong gradient fails it.

fp8 is ``Float8Precision``: torchao's float8 linears (dynamic per-tensor scales, e4m3 inputs,
e5m2 gradients) under bf16 autocast. The CPU has no fp8 matmuls, so the cases run torchao's
emulation (``emulate=True``): the inputs are rounded to fp8 exactly as on the GPU and the
matmuls run in higher precision. What a layout changes, and what these cases check, is where
the scales and roundings happen: a data-parallel rank scales its half of the batch, a
tensor-parallel rank its shard of a weight (torchao takes the amax over the whole DTensor), and
the measuring runs of tests/distributed/tolerance.py (the reference with its batch accumulated
in parts) scale per part the same way. The case names ``precision="fp8"``; the worker turns it
into the plugin (tests/distributed/worker.py, ``_precision_kwargs``).

One launch of its own: torchao is put on the path of the processes that run fp8 only, since
Hugging Face transformers imports it wherever it is importable.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES, Case, GradientFault, hybrid
from tests.distributed.harness import Result, run_cases
from tests.distributed.tolerance import check_low_precision, with_split_references
from tests.optional_packages import EXTRAS

pytestmark = [pytest.mark.distributed]

FP8 = {"trainer_kwargs": {"precision": "fp8"}, "data": "learnable"}
CASES_FP8 = [
    CASES.get(name) or hybrid(name, "recipe_gpt", world_size=2, timeout=60, case_fields=FP8, **kwargs)
    for name, kwargs in {
        "hybrid_dp2_fp8_recipe_gpt": {},
        "hybrid_tp2_sp_fp8_recipe_gpt": {"tensor_parallel": 2, "sequence_parallel": True},
    }.items()
]
GUARDED = "hybrid_tp2_sp_fp8_recipe_gpt"
FAULTS = {"dropped": GradientFault(".0.mlp.", 0.0), "doubled": GradientFault(".1.mlp.", 2.0)}


def _faulty(kind: str) -> Case:
    return CASES[GUARDED].replace(name=f"{GUARDED}~{kind}", gradient_fault=FAULTS[kind])


@pytest.fixture(scope="module")
def fp8_results() -> dict[str, Result]:
    assert (EXTRAS / "torchao").is_dir(), (
        "torchao is missing: scripts/setup_env.sh installs it in .venv/extras"
    )
    faulty = [_faulty(kind) for kind in FAULTS]
    return run_cases([*CASES_FP8, *faulty], 2, timeout_s=600, references_for=with_split_references(CASES_FP8))


# No compat mark: fp8's scaling noise (measured 9-15 units of bf16 per weight) leaves every weight 2-4 of its
# tolerances of movement in 4-8 steps, never the ten that judge it (tests/distributed/tolerance.py): the
# matrix does not count these runs; they are compared within the tolerance, and a wrong gradient still fails.
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", [c.name for c in CASES_FP8])
def test_fp8_matches_single_process_within_its_measured_tolerance(
    fp8_results: dict[str, Result], name: str
) -> None:
    result = fp8_results[name]
    assert result.engagement.get("float8_linears", 0) > 0, result.engagement
    check_low_precision(result, CASES[name], judged=False)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_a_wrong_layer_gradient_fails_the_fp8_parity_check(fp8_results: dict[str, Result], kind: str) -> None:
    """Negative control: the first block's MLP gradient dropped, or the second's doubled."""
    with pytest.raises(AssertionError, match="outside its measured tolerance") as failure:
        check_low_precision(fp8_results[_faulty(kind).name], CASES[GUARDED], judged=False)
    assert "parameter model." in str(failure.value)
