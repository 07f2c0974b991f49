"""Fused projections stored as row layouts, torch 2.11's path, at parity with one process on any torch.

torch before 2.13 cannot run ``_StridedShard`` (the placement fused q|k|v and gate|up get on 2.13) through
``F.linear`` and its redistributions; there each rank stores the same local rows as plain ``Shard`` of a
row-permuted tensor (``tensor_parallel/styles.py: fused_rows``). ``LP_FUSED_AS_ROWS=1`` takes that path on
2.13 too, so both paths are tested wherever the suite runs: the recipe GPT's ``nn.Linear`` q|k|v, Hugging
Face GPT-2's ``Conv1D`` ``c_attn`` (rows along dim 1 of its weight) under sequence parallelism, and
Phi-3's fused gate|up (2 parts) beside its q|k|v of unequal widths; and under ZeRO with tp x dp, on
DeepSpeed's engine (ZeRO-1) and on FSDP2 (ZeRO-3).
"""

from __future__ import annotations

import pytest

from lightning_parallel.compat import FUSED_AS_ROWS_ENV
from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases

pytestmark = [pytest.mark.distributed]


def _case(name: str, family: str, world_size: int = 2, **kwargs: object) -> Case:
    name = f"fused_as_rows_{name}"
    return CASES.get(name) or hybrid(
        name, family, world_size=world_size, timeout=60, tensor_parallel=2, **kwargs
    )


FUSED = [
    _case("tp2_recipe_gpt", "recipe_gpt"),
    _case("tp2_sp_hf_gpt2", "hf_gpt2", sequence_parallel=True),
    _case("tp2_phi3", "zoo_phi3", case_fields={"steps": 3}),
]


# Under ZeRO x tp x dp (4 processes): DeepSpeed's engine holds the local shards behind a parametrization,
# FSDP2 replaces the parameters; both must still name the row layout (found by the torch 2.11 run).
ZERO = [
    _case("zero1_tp2_dp2_nanogpt", "nanogpt", world_size=4, zero_stage=1),
    _case("zero3_tp2_dp2_nanogpt", "nanogpt", world_size=4, zero_stage=3),
]


def _run(cases: list[Case], world_size: int) -> dict[str, Result]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FUSED_AS_ROWS_ENV, "1")  # the workers inherit it
        return run_cases(cases, world_size, timeout_s=600, references_for=cases)


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    return _run(FUSED, 2)


@pytest.fixture(scope="module")
def zero_results() -> dict[str, Result]:
    return _run(ZERO, 4)


@pytest.mark.parametrize("case", FUSED, ids=lambda c: c.name)
def test_fused_projection_as_rows_matches_one_process(results: dict[str, Result], case: Case) -> None:
    assert_parity(results[case.name], reference(case))


@pytest.mark.parametrize("case", ZERO, ids=lambda c: c.name)
def test_fused_projection_as_rows_under_zero(zero_results: dict[str, Result], case: Case) -> None:
    assert_parity(zero_results[case.name], reference(case))
