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
from tests.distributed.harness import Result, assert_parity, precision_problems, reference, run_cases
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

# The MoE families' experts in the precision asked for: transformers computes them with torch._grouped_mm, which has
# no autocast rule of torch's; the precision plugins register one (lightning_parallel/precision/grouped_mm_autocast.py).
MIXED_LAYOUTS = {"zero2": {"zero_stage": 2}, "tp2": {"tensor_parallel": 2}, "ep2": {"expert_parallel": 2}}


def _mixed(family: str, layout: str, precision: str = "bf16-mixed", switch_off: str | None = None) -> Case:
    name = f"zoo_{family}_{layout}_{precision}" + (f"~{switch_off}" if switch_off else "")
    if name in CASES:
        return CASES[name]
    return hybrid(name, f"zoo_{family}", timeout=60, case_fields={"steps": 2, "trainer_kwargs": {"precision": precision},
                  "switch_off": switch_off}, **MIXED_LAYOUTS[layout])  # fmt: skip


MIXED = [
    *[_mixed(f, layout) for f, family in ZOO.items() if family.moe for layout in MIXED_LAYOUTS],
    _mixed("qwen3_moe", "zero2", "16-mixed"),
]
GROUPED_MM_RULE_OFF = _mixed("qwen3_moe", "zero2", switch_off="grouped_mm_autocast")
# zero_gather_dtype="compute" (FSDP2 gathers bf16 copies) on families whose code reads their parameters in other ways:
# Gemma's (1 + weight) norm, BLOOM's ALiBi and fused qkv, Falcon's parallel block, DeepSeek-V3's MLA and experts.
MIXED_LAYOUTS["zero3_gcompute"] = {"zero_stage": 3, "zero_gather_dtype": "compute"}
GATHERED = [_mixed(f, "zero3_gcompute") for f in ("gemma", "bloom", "falcon", "deepseek_v3")]


def _cases(params: list) -> list[Case]:
    return [p.values[0] for p in params]


@pytest.fixture(scope="module")
def two_process() -> dict[str, Result]:
    cases = [*_cases(TWO), ROW_COPIES_OFF, *MIXED, GROUPED_MM_RULE_OFF, *GATHERED]
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


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", MIXED, ids=lambda c: c.name)
def test_the_experts_of_a_moe_family_compute_in_the_precision_asked_for(
    two_process: dict[str, Result], case: Case
) -> None:
    """Every product of the forward and its recomputation in the low dtype, the grouped expert products
    included (they ran in fp32 under every layout before the rule), on DeepSpeed's engine, tp and ep."""
    result, ref = two_process[case.name], reference(case)
    assert precision_problems(result, ref) == []
    low = "bfloat16" if case.trainer_kwargs["precision"] == "bf16-mixed" else "float16"
    grouped = {k: v for k, v in result.compute_dtypes.items() if "_grouped_mm" in k}
    assert grouped and all(k.endswith(low) for k in grouped), grouped  # engaged: the experts ran grouped


@pytest.mark.timeout(1200)
def test_grouped_products_without_the_autocast_rule_fail_the_record(two_process: dict[str, Result]) -> None:
    """Negative control: torch's grouped matmul as torch ships it (no autocast rule) keeps the experts in fp32."""
    problems = precision_problems(two_process[GROUPED_MM_RULE_OFF.name], reference(GROUPED_MM_RULE_OFF))
    assert len(problems) == 1 and "_grouped_mm.float32" in problems[0], problems


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", GATHERED, ids=lambda c: c.name)
def test_a_family_trains_with_compute_gathers(two_process: dict[str, Result], case: Case) -> None:
    """Every dp all-gather in bf16 (the option's engagement row), every product in bf16, and the first step's loss
    that of the one-process run of the rule (the same 16-bit copies of the same weights: only the mean over the
    ranks rounds apart, measured at most 1e-7 of the loss; with fp32 gathers, autocast's numbers, it is not)."""
    result, ref = two_process[case.name], reference(case)
    assert result.engagement_problems == [], result.engagement_problems
    assert precision_problems(result, ref) == []
    assert abs(result.losses[0] - ref.losses[0]) <= 1e-6 * abs(ref.losses[0]), (result.losses, ref.losses)
