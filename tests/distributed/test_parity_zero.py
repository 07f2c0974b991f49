"""DeepSpeed ZeRO inside HybridParallelStrategy reproduces the single-process run.

fp32, per-step loss within 1e-5 relative and the final parameters element-wise (the project's
parity rule), for ZeRO stages 1, 2, 3 on dp=2, each with and without CPU offload, stage 3 with
NVMe offload to a temporary folder, and ZeRO-1 composed with tensor (tp=2), expert (ep=2) and
pipeline (pp=2) parallelism. Offloading runs Adam (as DeepSpeed's CPU Adam), the rest SGD.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import assert_parity, reference, run_cases

pytestmark = [pytest.mark.distributed]


def _case(name: str, family: str, world_size: int = 2, model_kwargs: dict | None = None, **kwargs: object) -> Case:
    if name in CASES:
        return CASES[name]
    fields = {"model_kwargs": model_kwargs} if model_kwargs else {}
    return hybrid(name, family, world_size=world_size, timeout=60, case_fields=fields, **kwargs)


ADAM = {"optimizer": "adamw"}
DP2 = [
    *[_case(f"zero{s}_dp2_nanogpt", "nanogpt", zero_stage=s) for s in (1, 2, 3)],
    *[_case(f"zero{s}_cpu_dp2_nanogpt", "nanogpt", zero_stage=s, offload="cpu", model_kwargs=ADAM) for s in (1, 2, 3)],
]

# ZeRO-1 composed with the other parallelisms, each with 2 data-parallel ranks to shard over.
FOUR = [
    _case("zero1_tp2_dp2_nanogpt", "nanogpt", 4, zero_stage=1, tensor_parallel=2),
    _case("zero2_tp2_dp2_nanogpt", "nanogpt", 4, zero_stage=2, tensor_parallel=2),
    _case("zero1_pp2_dp2_nanogpt", "nanogpt", 4, zero_stage=1, pipeline_parallel=2,
          pipeline_schedule="1f1b", micro_batches=2),
    _case("zero1_ep2_dp2_hf_mixtral", "hf_mixtral", 4, zero_stage=1, expert_parallel=2),
]  # fmt: skip


def test_zero_stages_on_two_ranks() -> None:
    results = run_cases(DP2, world_size=2)
    for case in DP2:
        assert_parity(results[case.name], reference(case))


def test_zero_composed_on_four_ranks() -> None:
    results = run_cases(FOUR, world_size=4)
    for case in FOUR:
        assert_parity(results[case.name], reference(case))
