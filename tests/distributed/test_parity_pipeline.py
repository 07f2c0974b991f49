"""Pipeline parallelism reproduces the single-process run (fp32, 1e-5 per step, final parameters).

Every schedule of ``torch.distributed.pipelining`` on pp=2 (nanoGPT-style model, 4 blocks),
interleaving with 2 virtual stages, the three model families (the recipe GPT with its tied
embedding/head split across the first and last stage, nanoGPT, Hugging Face Llama), gradient
accumulation with clipping by the global norm across stages, every schedule in bf16/fp16 mixed
and true precision, and the compositions pp=2 x tp=2 (with and without sequence parallelism),
pp=2 x dp=2 (both for every schedule) and pp=2 x tp=2 x dp=2 (8 processes). One launch per world size runs all of its cases over one process group.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases
from tests.distributed.tolerance import check_low_precision, with_split_references

pytestmark = [pytest.mark.distributed]

FAMILIES = ["recipe_gpt", "nanogpt", "hf_llama"]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"]
DEEP = {"n_layer": 4}  # 4 blocks: 2 stages x 2 virtual stages for the interleaved schedules
FIELDS = {"model_kwargs": DEEP, "batch_size": 4}


def _case(name: str, family: str, world_size: int = 2, fields: dict | None = None, **kwargs: object) -> Case:
    if name in CASES:
        return CASES[name]
    return hybrid(name, family, world_size=world_size, pipeline_parallel=2, timeout=60,
                  case_fields={**FIELDS, **(fields or {})}, **kwargs)  # fmt: skip


TWO = [
    *[_case(f"pp2_{s}_nanogpt", "nanogpt", pipeline_schedule=s, micro_batches=4) for s in SCHEDULES],
    *[_case(f"pp2_1f1b_{f}", f, pipeline_schedule="1f1b") for f in FAMILIES if f != "nanogpt"],
    *[
        _case(f"pp2_interleaved_{f}", f, pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=2)
        for f in FAMILIES
        if f != "nanogpt"
    ],  # fmt: skip
    # Accumulation (the schedule's gradients are added after Lightning's zero_grad) and clipping
    # by the norm over both stages, the tied embedding/head counted once; 0.05 clips.
    _case(
        "pp2_accum_clip_recipe_gpt",
        "recipe_gpt",
        pipeline_schedule="1f1b",
        fields={"trainer_kwargs": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}},
    ),
    _case("pp2_boundaries_nanogpt", "nanogpt", plan={"pipeline_boundaries": [1]}),
    # The step returns a dict with "loss" and more (Lightning allows it): the schedule takes the loss.
    _case("pp2_dict_output_recipe_gpt", "recipe_gpt_dict", pipeline_schedule="1f1b"),
    # Per-layer embeddings made at model level and read by every block (Gemma 3n's and 4's kind): the weights
    # live on both stages, each computes them, their gradients are summed (tests/pipeline/test_stages.py).
    _case(
        "pp2_per_layer_inputs",
        "per_layer_inputs",
        pipeline_schedule="interleaved_1f1b",
        pipeline_virtual_stages=2,
    ),
    # Block 1 stores in a dict what block 2 reads (keys and values shared across layers): the balanced cut before
    # block 2 moves so that both run on one stage (pipeline/handed_state.py; negative control in test_stages.py).
    _case(
        "pp2_shared_state_pair", "per_layer_inputs", fields={"model_kwargs": {**DEEP, "share_state": "pair"}}
    ),
    # A hidden state handed on as a transposed view: the stage sends it contiguous, receives into contiguous buffers.
    _case(
        "pp2_strided_hidden", "per_layer_inputs", fields={"model_kwargs": {**DEEP, "strided_hidden": True}}
    ),
]
BF16 = [
    _case(
        "pp2_bf16_recipe_gpt",
        "recipe_gpt",
        fields={"trainer_kwargs": {"precision": "bf16-mixed"}, "data": "learnable", "steps": 6},
    )
]
# Every schedule in every low precision (the compatibility matrix, docs/compatibility.md): the
# schedule runs autocast, fp16 loss scaling (overflow decided by all stages) and half-precision
# weights per micro-batch and stage. Two carry activation checkpointing, for its precision pairs.
# "16-mixed" is fp16 autocast with the loss scaled on the CPU too (the worker passes the plugin: the flag
# alone would become bf16-mixed there), every stage's scaled losses unscaled by one scale.
LOW_PRECISIONS = ["bf16-mixed", "bf16-true", "16-true", "16-mixed"]
# bf16 weights: at three times the rate every weight moves ten of its tolerances (tests/distributed/tolerance.py).
BF16_TRUE_RATE = {**DEEP, "learning_rate": 0.3}
AC_IN_LOW_PRECISION = {("gpipe", "bf16-true"): "full", ("looped_bfs", "bf16-mixed"): "selective"}
LOW_PRECISION = [
    *BF16,
    *[
        _case(f"pp2_{s}_{p}_nanogpt", "nanogpt", fields={"trainer_kwargs": {"precision": p}, "data": "learnable", "steps": 6,
                                                        **({"model_kwargs": BF16_TRUE_RATE} if p == "bf16-true" else {})},
              pipeline_schedule=s,
              micro_batches=4, activation_checkpointing=AC_IN_LOW_PRECISION.get((s, p)))
        for s in SCHEDULES
        for p in LOW_PRECISIONS
        if (s, p) != ("1f1b", "bf16-mixed")  # pp2_bf16_recipe_gpt
    ],
]  # fmt: skip
FOUR = [
    *[_case(f"pp2_tp2_{f}", f, world_size=4, tensor_parallel=2) for f in FAMILIES],
    _case(
        "pp2_tp2_sp_interleaved_hf_llama",
        "hf_llama",
        world_size=4,
        tensor_parallel=2,
        sequence_parallel=True,
        pipeline_schedule="interleaved_1f1b",
    ),
    *[_case(f"pp2_dp2_{f}", f, world_size=4) for f in ("recipe_gpt", "hf_llama") if f in FAMILIES],
    # Accumulation with data parallelism: the data-parallel mean runs during the stages' last backward of
    # the window's last batch, on the window's whole gradient (the schedule adds to the earlier batches'),
    # the tied embedding/head summed across stages after it; clipping by the norm over both stages.
    _case("pp2_dp2_accum_clip_recipe_gpt", "recipe_gpt", world_size=4,
          fields={"trainer_kwargs": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, "steps": 3}),
    # Every other schedule with tensor + sequence parallelism and with data parallelism (the
    # compatibility matrix). Two steps and the fewest micro-batches each schedule takes: four
    # processes on two cores make each tensor-parallel collective slow.
    *[
        _case(f"pp2_tp2_sp_{s}_nanogpt", "nanogpt", world_size=4, tensor_parallel=2, sequence_parallel=True,
              pipeline_schedule=s, micro_batches=4 if s == "dualpipev" else 2, fields={"steps": 2})
        for s in SCHEDULES
        if s not in ("1f1b", "interleaved_1f1b")  # pp2_tp2_*, pp2_tp2_sp_interleaved_hf_llama
    ],
    *[
        _case(f"pp2_dp2_{s}_nanogpt", "nanogpt", world_size=4, pipeline_schedule=s,
              micro_batches=4 if s == "dualpipev" else 2, fields={"steps": 2})
        for s in SCHEDULES
        if s != "1f1b"  # pp2_dp2_*
    ],
]  # fmt: skip
EIGHT = [
    _case("pp2_tp2_dp2_sp_recipe_gpt", "recipe_gpt", world_size=8, tensor_parallel=2, sequence_parallel=True)
]


def _run(cases: list[Case], world_size: int, timeout_s: float) -> dict[str, Result]:
    return run_cases(cases, world_size, timeout_s=timeout_s, references_for=with_split_references(cases))


@pytest.fixture(scope="module")
def two_process() -> dict[str, Result]:
    return _run(TWO + LOW_PRECISION, 2, 600)


@pytest.fixture(scope="module")
def four_process() -> dict[str, Result]:
    return _run(FOUR, 4, 600)


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", TWO, ids=lambda c: c.name)
def test_pipeline_two_processes(two_process: dict[str, Result], case: Case) -> None:
    result = two_process[case.name]
    assert result.global_step == case.steps
    assert_parity(result, reference(case))


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", LOW_PRECISION, ids=lambda c: c.name)
def test_pipeline_low_precision_within_its_tolerance(two_process: dict[str, Result], case: Case) -> None:
    """bf16/fp16, mixed and true: losses and every parameter within the tolerance measured on the
    one-process run in the same precision (tests/distributed/tolerance.py)."""
    check_low_precision(two_process[case.name], case)


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", FOUR, ids=lambda c: c.name)
def test_pipeline_four_processes(four_process: dict[str, Result], case: Case) -> None:
    result = four_process[case.name]
    assert result.global_step == case.steps
    assert_parity(result, reference(case))


@pytest.mark.compat(cases=EIGHT)
@pytest.mark.timeout(900)
def test_pipeline_tensor_data_parallel_eight_processes() -> None:
    (case,) = EIGHT
    result = _run(EIGHT, 8, 600)[case.name]
    assert_parity(result, reference(case))
