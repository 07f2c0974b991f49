"""The parity checks fail when one layer's gradient is wrong: dropped (x0) or doubled (x2).

A test that cannot fail proves nothing. Each case here is a passing parity case of the suite with
one layer's gradient scaled before every optimizer step (``Case.gradient_fault``, applied in the
distributed run only), and the check that guards the original case must reject it: the fp32 rule
(:func:`assert_parity`) and the measured low-precision rule (:func:`check_low_precision`), under
data, tensor + sequence and pipeline parallelism, in bf16 mixed and true and in fp16. The compute-dtype
record's negative controls: tests/distributed/test_compute_dtype.py, test_parity_zero.py (DeepSpeed's
engine config before issue 33, and a fp32 run judged against a bf16-mixed reference). And a
feature switched off behind the strategy's back (``Case.switch_off``) fails on its engagement.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES, Case, GradientFault
from tests.distributed.harness import Result, assert_parity, reference, run_cases
from tests.distributed.tolerance import check_low_precision, with_split_references

pytestmark = [pytest.mark.distributed]

# Substrings of the user's parameter names in every family: the first block's MLP, the second's.
FAULTS = {"dropped": GradientFault(".0.mlp.", 0.0), "doubled": GradientFault(".1.mlp.", 2.0)}
GUARDED = [
    "hybrid_dp2_bf16-mixed_ac_full_recipe_gpt",
    "hybrid_tp2_sp_bf16true_nanogpt",
    "hybrid_tp2_sp_16-true_ac_full_nanogpt",
    "pp2_gpipe_bf16-true_nanogpt",
    "hybrid_tp2_sp_hf_llama",  # fp32: the 1e-5 rule
]


def _guarded() -> list[Case]:
    import tests.distributed.test_parity_hybrid  # noqa: F401  (registers the cases)
    import tests.distributed.test_parity_pipeline  # noqa: F401

    return [CASES[name] for name in GUARDED]


def _faulty(case: Case, kind: str) -> Case:
    return case.replace(name=f"{case.name}~{kind}", gradient_fault=FAULTS[kind])


SWITCHED_OFF = (
    "hybrid_tp2_sp_16-true_ac_full_nanogpt"  # activation checkpointing undone behind the strategy's back
)


def _switched_off() -> Case:
    return CASES[SWITCHED_OFF].replace(name=f"{SWITCHED_OFF}~ac-off", switch_off="activation_checkpointing")


@pytest.fixture(scope="module")
def faulty() -> dict[str, Result]:
    cases = [_faulty(case, kind) for case in _guarded() for kind in FAULTS] + [_switched_off()]
    return run_cases(cases, 2, timeout_s=600, references_for=with_split_references(_guarded()))


@pytest.mark.timeout(700)
@pytest.mark.parametrize("kind", sorted(FAULTS))
@pytest.mark.parametrize("name", GUARDED)
def test_a_wrong_layer_gradient_fails_the_parity_check(
    faulty: dict[str, Result], name: str, kind: str
) -> None:
    case = CASES[name]
    result = faulty[_faulty(case, kind).name]
    low_precision = "precision" in case.trainer_kwargs
    with pytest.raises(AssertionError, match="outside its measured tolerance|does not match") as failure:
        if low_precision:
            check_low_precision(result, case.replace(gradient_fault=None))
        else:
            assert_parity(result, reference(case))
    assert "parameter model." in str(failure.value)  # caught on the parameters, not only the losses


@pytest.mark.timeout(700)
def test_a_feature_switched_off_behind_the_strategys_back_fails_on_its_engagement(
    faulty: dict[str, Result],
) -> None:
    """Undoing the recomputation changes no number, so only the engagement record can tell."""
    result = faulty[_switched_off().name]
    with pytest.raises(AssertionError, match="not engaged: ac=full"):
        check_low_precision(result, CASES[SWITCHED_OFF])
