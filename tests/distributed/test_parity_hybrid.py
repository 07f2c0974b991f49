"""HybridParallelStrategy reproduces the single-process run (fp32, 1e-5) on four model families.

Layouts: dp=2, tp=2, tp=2 with sequence parallelism (2 processes), dp=2 x tp=2 (4 processes),
and, within the low-precision tolerance, dp=2 and tp=2 x sp in bf16/fp16 (mixed and true),
on the recipe GPT, a nanoGPT-style model (fused ``c_attn`` split by ``n_embd``, ``view`` with
the global width), Hugging Face GPT-2 (``Conv1D``) and Llama (separate q/k/v, grouped KV heads,
RMSNorm, rotary embeddings). Every family trains through the real ``lightning.Trainer``;
per-batch losses and final parameters are compared with the same module trained in one
process on the global batch. One launch per world size runs all of its cases.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.distributed.cases import CASES, Case, hybrid, register
from tests.distributed.harness import Result, assert_parity, launch_fails, reference, run_cases
from tests.distributed.tolerance import check_low_precision, with_split_references

FAMILIES = ["recipe_gpt", "nanogpt", "hf_gpt2", "hf_llama"]
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


ACCUM_CLIP = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
EXTRA_TWO = [
    # Gradient accumulation (data-parallel sync skipped on the first micro-batch) and clipping by
    # the global norm over tensor-parallel shards; 0.05 is below the gradient norm, so it clips.
    hybrid(
        "hybrid_tp2_sp_accum_clip_nanogpt",
        "nanogpt",
        world_size=2,
        tensor_parallel=2,
        sequence_parallel=True,
        timeout=60,
        case_fields={"trainer_kwargs": ACCUM_CLIP},
    ),
    hybrid(
        "hybrid_tp2_accum_clip_hf_gpt2",
        "hf_gpt2",
        world_size=2,
        tensor_parallel=2,
        timeout=60,
        case_fields={"trainer_kwargs": ACCUM_CLIP},
    ),
]
# OPT: a key-projection bias whose gradient is zero in exact arithmetic (once a false refusal). Under
# sequence parallelism (its layer is its own MLP, flattened before its norm): tests/distributed/test_sweep_traits.py.
EXTRA_TWO.append(hybrid("hybrid_tp2_hf_opt", "hf_opt", world_size=2, timeout=60, tensor_parallel=2))
# Blocks adding a per-layer input made at model level, per token, beside a split MLP (Gemma 3n's and 4's kind):
# under sequence parallelism each block meets the slice of it that matches its slice of the sequence.
PER_LAYER_SP = hybrid(
    "hybrid_tp2_sp_per_layer_inputs", "per_layer_inputs", world_size=2, timeout=60, tensor_parallel=2,
    sequence_parallel=True, case_fields={"model_kwargs": {"mlp": True}},
)  # fmt: skip
EXTRA_TWO.append(PER_LAYER_SP)
# Qwen3: per-head q/k RMSNorms inside the attention, a shared weight whose gradient sums over the ranks.
EXTRA_TWO += [
    hybrid(f"hybrid_{layout}_hf_qwen3", "hf_qwen3", world_size=2, timeout=60, tensor_parallel=2, **kwargs)
    for layout, kwargs in {"tp2": {}, "tp2_sp": {"sequence_parallel": True}}.items()
]
EXTRA_FOUR = [
    hybrid(
        "hybrid_dp2_tp2_sp_clip_hf_llama",
        "hf_llama",
        world_size=4,
        tensor_parallel=2,
        sequence_parallel=True,
        timeout=60,
        case_fields={"trainer_kwargs": {"gradient_clip_val": 0.05}},
    ),
]
LOSS_PARALLEL = [
    # Vocabulary-parallel cross-entropy on sharded logits (no all-gather of the logits).
    hybrid(
        "hybrid_tp2_sp_loss_parallel_recipe_gpt",
        "recipe_gpt",
        world_size=2,
        tensor_parallel=2,
        sequence_parallel=True,
        loss_parallel=True,
        timeout=60,
    ),
    hybrid(
        "hybrid_tp2_loss_parallel_clip_hf_llama",
        "hf_llama",
        world_size=2,
        tensor_parallel=2,
        loss_parallel=True,
        timeout=60,
        case_fields={"trainer_kwargs": {"gradient_clip_val": 0.05}},
    ),
]
BF16 = [
    hybrid(
        "hybrid_tp2_sp_bf16_recipe_gpt",
        "recipe_gpt",
        world_size=2,
        tensor_parallel=2,
        sequence_parallel=True,
        timeout=60,
        case_fields={"trainer_kwargs": {"precision": "bf16-mixed"}, "data": "learnable"},
    ),
    # bf16 weights: six steps at twice the rate move every weight ten of its tolerances (tests/distributed/tolerance.py).
    hybrid(
        "hybrid_tp2_sp_bf16true_nanogpt",
        "nanogpt",
        world_size=2,
        tensor_parallel=2,
        sequence_parallel=True,
        timeout=60,
        case_fields={
            "trainer_kwargs": {"precision": "bf16-true"},
            "data": "learnable",
            "steps": 6,
            "model_kwargs": {"learning_rate": 0.2},
        },
    ),
]
# Runs whose weights cannot move ten of their tolerances (Llama's query and key projections hardly train in a
# few steps, 1-3 tolerances in bf16 weights): compared within the tolerance, never counted in the matrix.
UNJUDGED = [
    hybrid(
        "hybrid_tp2_sp_bf16true_hf_llama",
        "hf_llama",
        world_size=2,
        tensor_parallel=2,
        sequence_parallel=True,
        timeout=60,
        case_fields={"trainer_kwargs": {"precision": "bf16-true"}, "data": "learnable"},
    ),
]
# The rest of the compatibility matrix (docs/compatibility.md): data parallelism in every low
# precision and tensor + sequence parallelism in fp16 (true, and mixed: fp16 autocast with the loss
# scaled, tests/distributed/worker.py), each carrying one activation-checkpointing mode for its precision pair.
BF16 += [
    *[
        hybrid(f"hybrid_dp2_{precision}_ac_{mode}_recipe_gpt", "recipe_gpt", world_size=2, timeout=60,
               activation_checkpointing=mode,
               case_fields={"trainer_kwargs": {"precision": precision}, "data": "learnable"})
        for precision, mode in [("bf16-mixed", "full"), ("16-true", "selective"), ("16-mixed", "full")]
    ],
    # bf16 weights: nanoGPT, six steps at twice the rate (the recipe, whose rate is its own, needs eight for 10.1).
    hybrid("hybrid_dp2_bf16-true_ac_selective_nanogpt", "nanogpt", world_size=2, timeout=60,
           activation_checkpointing="selective",
           case_fields={"trainer_kwargs": {"precision": "bf16-true"}, "data": "learnable", "steps": 6,
                        "model_kwargs": {"learning_rate": 0.2}}),
    *[
        hybrid(f"hybrid_tp2_sp_{precision}_ac_{mode}_nanogpt", "nanogpt", world_size=2, tensor_parallel=2,
               sequence_parallel=True, timeout=60, activation_checkpointing=mode,
               case_fields={"trainer_kwargs": {"precision": precision}, "data": "learnable"})
        for precision, mode in [("bf16-mixed", "selective"), ("16-true", "full"), ("16-mixed", "selective")]
    ],
]  # fmt: skip

TWO = _cases(TWO_PROCESS_LAYOUTS, 2) + EXTRA_TWO + LOSS_PARALLEL + BF16 + UNJUDGED
FOUR = _cases(FOUR_PROCESS_LAYOUTS, 4) + EXTRA_FOUR


@pytest.fixture(scope="module")
def two_process_results() -> dict[str, Result]:
    return run_cases(TWO, world_size=2, timeout_s=900, references_for=with_split_references(TWO + FOUR))


@pytest.fixture(scope="module")
def four_process_results() -> dict[str, Result]:
    return run_cases(FOUR, world_size=4, timeout_s=600, references_for=FOUR)


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.distributed
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", [c.name for c in TWO if c not in BF16 + UNJUDGED])
def test_two_process_layouts_match_single_process(two_process_results: dict[str, Result], name: str) -> None:
    result = two_process_results[name]
    assert result.world_size == 2
    assert_parity(result, reference(name))


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.distributed
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", [c.name for c in BF16])
def test_low_precision_matches_single_process_within_its_measured_tolerance(
    two_process_results: dict[str, Result], name: str
) -> None:
    """Losses and every parameter against the one-process run in the same precision (tests/distributed/tolerance.py)."""
    check_low_precision(two_process_results[name], CASES[name])


@pytest.mark.distributed
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", [c.name for c in UNJUDGED])
def test_low_precision_within_its_tolerance_unjudged(
    two_process_results: dict[str, Result], name: str
) -> None:
    """Within the tolerance and in the dtype asked for; its weights move too little to be judged: no compat mark."""
    check_low_precision(two_process_results[name], CASES[name], judged=False)


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.distributed
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", [c.name for c in FOUR])
def test_dp2_tp2_matches_single_process(four_process_results: dict[str, Result], name: str) -> None:
    result = four_process_results[name]
    assert result.world_size == 4 and result.data_parallel == 2
    assert_parity(result, reference(name))


@pytest.mark.timeout(300)
def test_negative_control_per_layer_inputs_left_whole_under_sequence_parallelism_are_refused() -> None:
    """The block's per-layer input left whole while the block holds its slice of the sequence: the block
    verification refuses the plan (shapes that do not match)."""
    case = (
        CASES.get("hybrid_tp2_sp_per_layer_inputs_without_slices")
        or register(
            replace(
                PER_LAYER_SP,
                name="hybrid_tp2_sp_per_layer_inputs_without_slices",
                switch_off="block_argument_slices",
            )
        )[0]
    )
    with launch_fails("does not reproduce the unsharded block"):
        run_cases([case], 2, timeout_s=180)
