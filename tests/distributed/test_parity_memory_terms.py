"""The memory terms of issue 34 removed, at parity with one process, each shown engaged on every rank.

- **No 16-bit copy of a weight kept for backward, one copy of an input read by several projections**
  (``memory/casts.py``): bf16-mixed cases at the low-precision rule; the forward and autograd graph are
  autocast's, so the same cases with the casts kept (``switch_off``) hold more but train alike.
- **Pipeline receive buffers for the micro-batches in flight only** (``pipeline/receive_buffers.py``): each
  stage makes exactly the buffers the planner counts on torch's schedule (GPipe, ZB-V with its split
  backward and same-rank passes, interleaved 1F1B with accumulation reusing them across batches).
- **Inputs gathered over tp kept as this rank's slice** (``memory/regather.py``): tp2 + sp in fp32 (Llama,
  nanoGPT) and bf16-mixed (the recipe GPT), every block's attention and MLP inputs sliced and gathered again
  in backward; kept whole (``switch_off``) the run still matches and fails the check.
- **The vocabulary-parallel loss by default** (``tensor_parallel/vocab_loss.py``): tp2 (+ sp) on three
  families' own loss code, under pipeline stages too (pp2 x tp2), fp32 at 1e-5 and bf16-mixed.

Negative controls, in the same launches: ``loss_parallel=False`` computes no loss on the shards; casts and
buffers switched off fail their checks. Each still matches one process: these terms change what a rank
holds, never the numbers. The bytes each term costs before and after: ``tests/strategy/test_memory_terms.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.distributed.cases import Case, StrategySpec
from tests.distributed.harness import Result, assert_parity, reference, run_cases
from tests.distributed.memory_terms import (
    buffers_problems,
    casts_problems,
    read_records,
    regather_problems,
    sharded_loss_problems,
)
from tests.distributed.tolerance import check_low_precision, with_split_references

pytestmark = [pytest.mark.distributed]

RECORDS = Path(tempfile.mkdtemp(prefix="lp_memory_terms_"))
BF16 = {"trainer_kwargs": {"precision": "bf16-mixed"}, "data": "learnable", "steps": 6}


def _case(name: str, family: str, world_size: int = 2, switch_off: tuple[str, ...] = (),
          fields: dict | None = None, **strategy: object) -> Case:  # fmt: skip
    dp = world_size // (int(strategy.get("tensor_parallel", 1)) * int(strategy.get("pipeline_parallel", 1)))
    recorder = StrategySpec("tests.distributed.memory_terms:MemoryTerms",
                            {"directory": str(RECORDS / name), "switch_off": switch_off})  # fmt: skip
    spec = StrategySpec("lightning_parallel:HybridParallelStrategy", {"timeout": 60, **strategy})
    return Case(name, family, spec, world_size=world_size, data_parallel=dp, callbacks=(recorder,),
                **(fields or {}))  # fmt: skip


PIPE = {"model_kwargs": {"n_layer": 4}, "batch_size": 4}
TWO = [
    _case("mt_tp2_recipe_gpt", "recipe_gpt", tensor_parallel=2),
    _case("mt_tp2_sp_hf_llama", "hf_llama", tensor_parallel=2, sequence_parallel=True),
    _case("mt_tp2_nanogpt_opt_out", "nanogpt", tensor_parallel=2, loss_parallel=False),
    _case("mt_tp2_sp_nanogpt", "nanogpt", tensor_parallel=2, sequence_parallel=True),
    _case("mt_tp2_sp_nanogpt_whole", "nanogpt", tensor_parallel=2, sequence_parallel=True,
          switch_off=("regather",)),  # fmt: skip
    _case("mt_pp2_zbv_recipe_gpt", "recipe_gpt", pipeline_parallel=2, pipeline_schedule="zbv", micro_batches=4,
          fields=PIPE),  # fmt: skip
    _case("mt_pp2_interleaved_accum_nanogpt", "nanogpt", pipeline_parallel=2, micro_batches=4,
          pipeline_schedule="interleaved_1f1b", fields={**PIPE, "trainer_kwargs": {"accumulate_grad_batches": 2}}),
]  # fmt: skip
TWO_BF16 = [
    _case("mt_tp2_recipe_gpt_bf16", "recipe_gpt", tensor_parallel=2, fields=BF16),
    _case("mt_tp2_sp_recipe_gpt_bf16", "recipe_gpt", tensor_parallel=2, sequence_parallel=True, fields=BF16),
    _case(
        "mt_pp2_gpipe_recipe_gpt_bf16",
        "recipe_gpt",
        pipeline_parallel=2,
        pipeline_schedule="gpipe",
        micro_batches=4,
        fields={**PIPE, **BF16},
    ),  # fmt: skip
]
# Llama shares one cast of an input among q, k, v (gate, up). Compared but not judged: its query and key
# projections move only 3-9 tolerances in 6-8 steps (docs/testing.md), too little to judge them.
UNJUDGED_BF16 = [
    _case(
        "mt_pp2_gpipe_hf_llama_bf16",
        "hf_llama",
        pipeline_parallel=2,
        pipeline_schedule="gpipe",
        micro_batches=4,
        fields={**PIPE, **BF16},
    ),  # fmt: skip
    _case(
        "mt_pp2_gpipe_hf_llama_bf16_kept",
        "hf_llama",
        pipeline_parallel=2,
        pipeline_schedule="gpipe",
        micro_batches=4,
        switch_off=("casts", "buffers"),
        fields={**PIPE, **BF16},
    ),  # fmt: skip
]
FOUR = [
    _case(
        "mt_pp2_tp2_recipe_gpt",
        "recipe_gpt",
        world_size=4,
        tensor_parallel=2,
        pipeline_parallel=2,
        micro_batches=2,
        fields=PIPE,
    ),  # fmt: skip
]
ALL = {case.name: case for case in [*TWO, *TWO_BF16, *UNJUDGED_BF16, *FOUR]}


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    two = [*TWO, *TWO_BF16, *UNJUDGED_BF16]
    out = run_cases(two, 2, timeout_s=600, references_for=with_split_references(two))
    out.update(run_cases(FOUR, 4, timeout_s=400, references_for=FOUR))
    return out


def _records(name: str) -> list[dict]:
    return read_records(RECORDS / name, ALL[name].world_size)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c.name for c in [*TWO, *FOUR]])
def test_fp32_layouts_match_one_process(results: dict[str, Result], name: str) -> None:
    assert_parity(results[name], reference(ALL[name]))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c.name for c in TWO_BF16])
def test_bf16_layouts_match_one_process(results: dict[str, Result], name: str) -> None:
    check_low_precision(results[name], ALL[name])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c.name for c in UNJUDGED_BF16])
def test_bf16_llama_within_the_tolerance(results: dict[str, Result], name: str) -> None:
    check_low_precision(results[name], ALL[name], judged=False)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("name", "per_step"),
    [("mt_tp2_recipe_gpt", 1), ("mt_tp2_sp_hf_llama", 1), ("mt_tp2_sp_nanogpt", 1), ("mt_tp2_recipe_gpt_bf16", 1),
     ("mt_pp2_tp2_recipe_gpt", 2)],  # under stages: one loss per micro-batch
)  # fmt: skip
def test_the_loss_ran_on_the_vocabulary_shards(results: dict[str, Result], name: str, per_step: int) -> None:
    assert sharded_loss_problems(_records(name), per_step) == []


@pytest.mark.timeout(900)
def test_opting_out_gathers_the_logits(results: dict[str, Result]) -> None:
    """The negative control: ``loss_parallel=False`` (still at parity above) fails the check."""
    assert sharded_loss_problems(_records("mt_tp2_nanogpt_opt_out"), 1)


@pytest.mark.timeout(900)
def test_no_weight_copy_was_kept(results: dict[str, Result]) -> None:
    assert casts_problems(_records("mt_tp2_recipe_gpt_bf16"), shared=False) == []
    assert casts_problems(_records("mt_pp2_gpipe_recipe_gpt_bf16"), shared=False) == []
    assert casts_problems(_records("mt_pp2_gpipe_hf_llama_bf16"), shared=True) == []  # Llama's q|k|v, gate|up
    assert casts_problems(_records("mt_pp2_gpipe_hf_llama_bf16_kept"), shared=True)  # the negative control
    assert casts_problems(_records("mt_tp2_recipe_gpt"), shared=False)  # fp32: no casts at all


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["mt_pp2_zbv_recipe_gpt", "mt_pp2_interleaved_accum_nanogpt",
                                  "mt_pp2_gpipe_recipe_gpt_bf16", "mt_pp2_tp2_recipe_gpt"])  # fmt: skip
def test_receive_buffers_are_those_in_flight(results: dict[str, Result], name: str) -> None:
    assert buffers_problems(_records(name)) == []


@pytest.mark.timeout(900)
def test_torch_buffers_fail_the_check(results: dict[str, Result]) -> None:
    problems = buffers_problems(_records("mt_pp2_gpipe_hf_llama_bf16_kept"))
    assert problems and all("reuse on: False" in p for p in problems)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["mt_tp2_sp_hf_llama", "mt_tp2_sp_nanogpt", "mt_tp2_sp_recipe_gpt_bf16"])
def test_gathered_inputs_are_kept_as_slices(results: dict[str, Result], name: str) -> None:
    """Under sequence parallelism each block's attention and MLP inputs (gathered over tp in forward) are kept
    as this rank's slice and gathered again in backward: two per block (of 2) and step, on every rank."""
    assert regather_problems(_records(name), at_least=2 * 2 * ALL[name].steps) == []


@pytest.mark.timeout(900)
def test_gathered_inputs_kept_whole_fail_the_check(results: dict[str, Result]) -> None:
    """The negative control (at parity above): gathered inputs kept whole. Without sequence parallelism
    nothing is gathered in forward, so nothing is sliced either."""
    assert regather_problems(_records("mt_tp2_sp_nanogpt_whole"), at_least=4 * ALL["mt_tp2_sp_nanogpt"].steps)
    assert regather_problems(_records("mt_tp2_recipe_gpt"), at_least=1)
