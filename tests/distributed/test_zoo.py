"""Twenty-one Hugging Face causal LM families, unchanged, at parity with one process under each layout.

The zoo (``tests/models/zoo.py``): each family's own model code from a tiny config, the user's loss in
the step. Every family under tensor parallelism (tp=2) and pipeline parallelism (pp=2); those whose
attention needs its own treatment also under sequence parallelism (fused q|k|v of every layout, q/k norms,
ALiBi, k/v heads fewer than ranks), and at tp=4, where two k/v heads are fewer than the ranks; the MoE
families under expert parallelism (ep=2) and under sequence parallelism (each rank routing its slice of the
sequence). fp32, losses within 1e-5 per step and every final parameter (the row copies of a k/v head on
several ranks must agree too). Every test carries a ``zoo`` mark, from which ``python -m tools.compat_matrix`` writes the
per-family table of ``docs/compatibility.md``.

Negative control: Gemma's one k/v head stored on both ranks, its copies' gradients not summed, fails.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases
from tests.models.zoo import ZOO

pytestmark = [pytest.mark.distributed]

STEPS = 3
LAYOUTS = {
    "tp2": {"tensor_parallel": 2},
    "tp2+sp": {"tensor_parallel": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel": 2},
    "ep2": {"expert_parallel": 2},
    "tp4": {"tensor_parallel": 4},
    "tp2 x dp2": {"tensor_parallel": 2},
}
WORLD = {"tp4": 4, "tp2 x dp2": 4}
# The families whose attention needs more than plain column/row parallelism: also with sequence parallelism.
ATTENTION_CLASSES = ("gpt_neox", "bloom", "falcon", "phi3", "gemma", "gpt_bigcode", "olmo2", "cohere")
# MoE families under sequence parallelism: each tp rank routes its slice of the sequence through whole experts.
MOE_UNDER_SP = ("olmoe", "qwen3_moe")


def _case(family: str, layout: str, **fields: object) -> Case:
    name = f"zoo_{family}_{layout.replace(' ', '').replace('+', '_')}" + "".join(
        f"_{v}" for v in fields.values()
    )
    if name in CASES:
        return CASES[name]
    return hybrid(name, f"zoo_{family}", world_size=WORLD.get(layout, 2), timeout=60,
                  case_fields={"steps": STEPS, **fields}, **LAYOUTS[layout])  # fmt: skip


def _param(family: str, layout: str) -> object:
    return pytest.param(_case(family, layout), marks=pytest.mark.zoo(family=family, layout=layout),
                        id=f"{family}-{layout}")  # fmt: skip


TWO = [
    *[_param(f, layout) for f in ZOO for layout in ("tp2", "pp2")],
    *[_param(f, "tp2+sp") for f in (*ATTENTION_CLASSES, *MOE_UNDER_SP)],
    *[_param(f, "ep2") for f, family in ZOO.items() if family.moe],
]
FOUR = [_param(f, "tp4") for f in ("gemma", "gpt_bigcode", "phi3", "mistral")] + [
    _param("gemma", "tp2 x dp2")
]
ROW_COPIES_OFF = _case("gemma", "tp2", switch_off="row_copies")


def _cases(params: list) -> list[Case]:
    return [p.values[0] for p in params]


@pytest.fixture(scope="module")
def two_process() -> dict[str, Result]:
    cases = [*_cases(TWO), ROW_COPIES_OFF]
    return run_cases(cases, 2, timeout_s=900, references_for=cases)


@pytest.fixture(scope="module")
def four_process() -> dict[str, Result]:
    return run_cases(_cases(FOUR), 4, timeout_s=600, references_for=_cases(FOUR))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", TWO)
def test_a_family_trains_like_one_process(two_process: dict[str, Result], case: Case) -> None:
    assert_parity(two_process[case.name], reference(case))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FOUR)
def test_a_family_trains_like_one_process_on_four_ranks(four_process: dict[str, Result], case: Case) -> None:
    assert_parity(four_process[case.name], reference(case))


@pytest.mark.timeout(1200)
def test_row_copies_whose_gradients_are_not_summed_fail(two_process: dict[str, Result]) -> None:
    """Negative control: each rank's k/v head copy trained on its own queries' share drifts from the other."""
    with pytest.raises(AssertionError, match="copies of its rows"):
        assert_parity(two_process[ROW_COPIES_OFF.name], reference(ROW_COPIES_OFF))
