"""Expert parallelism on 2 gloo processes (raw process group, no Lightning) equals one process.

ONE launch runs every case (start-up dominates); each test reads its case's outcome. Per case:
outputs, input gradients, every parameter gradient (expert slices on their holder; replicated
parameters summed over ranks) and the routing statistics equal the single-process layer on the
whole batch, fp32, rtol 1e-5 / atol 1e-6 (see ``ep_workers`` for how losses are split).
"""

from __future__ import annotations

import functools

import pytest

from tests.experts import ep_workers as w
from tests.experts.spawn import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CASES = {
    "dropless_top2": dict(build=w.moe()),
    # capacity 0.75: a quarter of the assignments dropped; per-rank capacity would differ
    "drops_top2": dict(build=w.moe(capacity_factor=0.75), expect_drops=True, per_rank_differs=True),
    "drops_top1_rank_major": dict(
        build=w.moe(top_k=1, capacity_factor=1.0, token_order="rank_major"),
        order="rank_major",
        expect_drops=True,
        per_rank_differs=True,
    ),  # fmt: skip
    # every first choice to expert 0, second choices tie -> expert 1: rank 1 receives no token
    "all_to_one_expert_drops": dict(build=w.moe(capacity_factor=1.0), skew=0, expect_drops=True),
    "all_to_one_expert_dropless": dict(build=w.moe(), skew=3),
    "swiglu_bias_shared_8_experts": dict(
        build=w.moe(
            num_experts=8, activation="swiglu", bias=True, shared_expert_hidden_dim=8, normalize_top_k=True
        )
    ),
    "hf_mixtral_block_eager": dict(build=functools.partial(w.hf_mixtral_block, "eager")),
    "hf_mixtral_block_grouped_mm": dict(build=functools.partial(w.hf_mixtral_block, "grouped_mm")),
    "hf_qwen2_moe_block": dict(build=functools.partial(w.hf_qwen2_moe_block, "eager")),
    "module_list_block": dict(build=w.legacy_block),
    "module_list_block_shared_expert": dict(build=functools.partial(w.legacy_block, True)),
    "hf_mixtral_model_with_aux_collector": dict(fn=w.check_hf_model),
    "gradient_reduction_ep2": dict(fn=w.check_gradient_reduction, expert_parallel=True),
    "gradient_reduction_ep1_dp2": dict(fn=w.check_gradient_reduction, expert_parallel=False),
    "bad_input": dict(fn=w.check_bad_input),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(w.run_all, 2, (CASES,), timeout_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_ep2_equals_one_process(outcomes: list[dict], case: str) -> None:
    failures = [f"rank {r}:\n{o[case]}" for r, o in enumerate(outcomes) if not isinstance(o[case], dict)]
    assert not failures, "\n".join(failures)
