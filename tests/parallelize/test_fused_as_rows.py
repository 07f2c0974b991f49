"""Fused projections stored as row layouts, torch 2.11's path, at parity with one process on any torch.

torch before 2.13 cannot run ``_StridedShard`` (the placement fused q|k|v and gate|up get on 2.13) through
``F.linear`` and its redistributions; there each rank stores the same local rows as plain ``Shard`` of a
row-permuted tensor (``tensor_parallel/styles.py: fused_rows``). ``LP_FUSED_AS_ROWS=1`` takes that path on
2.13 too, so both paths are tested wherever the suite runs: the recipe GPT's ``nn.Linear`` q|k|v, Hugging
Face GPT-2's ``Conv1D`` ``c_attn`` (rows along dim 1 of its weight) under sequence parallelism, and
Phi-3's fused gate|up (2 parts) beside its q|k|v of unequal widths.
"""

from __future__ import annotations

import pytest

from lightning_parallel.compat import FUSED_AS_ROWS_ENV
from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases

pytestmark = [pytest.mark.distributed]


def _case(name: str, family: str, **kwargs: object) -> Case:
    name = f"fused_as_rows_{name}"
    return CASES.get(name) or hybrid(name, family, world_size=2, timeout=60, tensor_parallel=2, **kwargs)


FUSED = [
    _case("tp2_recipe_gpt", "recipe_gpt"),
    _case("tp2_sp_hf_gpt2", "hf_gpt2", sequence_parallel=True),
    _case("tp2_phi3", "zoo_phi3", case_fields={"steps": 3}),
]


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FUSED_AS_ROWS_ENV, "1")  # the workers inherit it
        return run_cases(FUSED, 2, timeout_s=600, references_for=FUSED)


@pytest.mark.parametrize("case", FUSED, ids=lambda c: c.name)
def test_fused_projection_as_rows_matches_one_process(results: dict[str, Result], case: Case) -> None:
    assert_parity(results[case.name], reference(case))
