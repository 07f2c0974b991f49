"""HybridParallelStrategy reproduces the single-process run (fp32, 1e-5) on four model families.

Layouts: dp=2, tp=2, tp=2 with sequence parallelism (2 processes), dp=2 x tp=2 (4 processes),
on the recipe GPT, a nanoGPT-style model (fused ``c_attn`` split by ``n_embd``, ``view`` with
the global width), Hugging Face GPT-2 (``Conv1D``) and Llama (separate q/k/v, grouped KV heads,
RMSNorm, rotary embeddings). Every family trains through the real ``lightning.Trainer``;
per-batch losses and final parameters are compared with the same module trained in one
process on the global batch. One launch per world size runs all of its cases.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases
from tests.models.families import available_families

FAMILIES = [f for f in ("recipe_gpt", "nanogpt", "hf_gpt2", "hf_llama") if f in available_families()]
TWO_PROCESS_LAYOUTS = {
    "dp2": {"tensor_parallel": 1},
    "tp2": {"tensor_parallel": 2},
    "tp2_sp": {"tensor_parallel": 2, "sequence_parallel": True},
}
FOUR_PROCESS_LAYOUTS = {"dp2_tp2": {"tensor_parallel": 2}}


def _cases(layouts: dict[str, dict], world_size: int) -> list[Case]:
    cases = []
    for family in FAMILIES:
        for layout, kwargs in layouts.items():
            name = f"hybrid_{layout}_{family}"
            cases.append(CASES.get(name) or hybrid(name, family, world_size=world_size, timeout=60, **kwargs))
    return cases


TWO = _cases(TWO_PROCESS_LAYOUTS, 2)
FOUR = _cases(FOUR_PROCESS_LAYOUTS, 4)


@pytest.fixture(scope="module")
def two_process_results() -> dict[str, Result]:
    return run_cases(TWO, world_size=2, timeout_s=900, references_for=TWO + FOUR)


@pytest.fixture(scope="module")
def four_process_results() -> dict[str, Result]:
    return run_cases(FOUR, world_size=4, timeout_s=600, references_for=FOUR)


@pytest.mark.distributed
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", [c.name for c in TWO])
def test_two_process_layouts_match_single_process(two_process_results: dict[str, Result], name: str) -> None:
    result = two_process_results[name]
    assert result.world_size == 2
    assert_parity(result, reference(name))


@pytest.mark.distributed
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", [c.name for c in FOUR])
def test_dp2_tp2_matches_single_process(four_process_results: dict[str, Result], name: str) -> None:
    result = four_process_results[name]
    assert result.world_size == 4 and result.data_parallel == 2
    assert_parity(result, reference(name))
