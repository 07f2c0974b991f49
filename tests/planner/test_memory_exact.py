"""The planner's memory per rank against what each rank of a real Trainer run holds (two CPU ranks, gloo).

Parameters, gradients and optimizer states are predicted exactly, on every rank, for data, tensor
(+ sequence), pipeline (each stage) and expert parallelism and ZeRO stages 1-3 (DeepSpeed's engine) and
ZeRO-2 with experts (FSDP2's engine). Activations held for backward are within 5% of what the project's
saved-tensor hooks count, without checkpointing and with full and selective checkpointing, stored compressed
(bf16, fp8) or in host memory (offload: the device's and the host's share each), under sequence parallelism and
across stages too, one or two a rank (the planner without the saver misses; with two stages a rank the saver
once offloaded the first stage's last block: 25% more than planned), and at the
peak of a step under 1F1B, GPipe, and, with two stages a rank, interleaved 1F1B and the zero-bubble schedules
(ZB-V, interleaved zero bubble, DualPipe-V: what a micro-batch saved stays until its weight pass), whose
differences (micro-batches in flight, and on which stage) are the point.

Negative controls: the planner's pipeline peak, given the other schedule, misses the measured peak; so does
interleaved 1F1B's warm-up spread evenly over a rank's stages; a tensor-parallel prediction made for the wrong
degree misses the parameter bytes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.memory import RankMemory, rank_memory
from lightning_parallel.strategy.auto_layout import choose_layout
from tests.models.families import SEQ_LEN, build
from tests.strategy import launch_for_results
from tests.strategy.scripts.planner_memory import BATCH, LAYOUTS, tiny_cluster

pytestmark = [pytest.mark.distributed]

ACTIVATION_TOLERANCE = 0.05  # the bound; the GPT recipe lands within 1%, Hugging Face Llama within 2%
# Routed experts: the tokens an expert rank receives are the router's choice, not the planner's (balanced).
# Measured: the two ranks of ep2 differ by 13% from each other; their mean is within 6% of the prediction.
EXPERT_RANK_TOLERANCE, EXPERT_MEAN_TOLERANCE = 0.2, 0.1
# Hugging Face Mixtral under tp2 + sp (each rank routing its slice): the planner's routed-expert terms are the
# library's MoE layer's; measured 5.5% below the prediction, equal on both ranks (parameters, gradients and
# optimizer states exact).
ROUTED_UNDER_SP = {"tp2_sp_moe"}


def _layout(strategy: dict, optimizer: str) -> Layout:
    micro_batches = strategy.get("micro_batches", 1)
    tp = strategy.get("tensor_parallel", 1)
    pp = strategy.get("pipeline_parallel", 1)
    return Layout(
        tensor_parallel=tp,
        sequence_parallel=strategy.get("sequence_parallel", False),
        pipeline_parallel=pp,
        pipeline_schedule=strategy.get("pipeline_schedule", "1f1b"),
        pipeline_virtual_stages=2
        if strategy.get("pipeline_schedule", "1f1b") not in ("1f1b", "gpipe")
        else 1,
        micro_batches=micro_batches,
        data_parallel=2 // (tp * pp),
        expert_parallel=strategy.get("expert_parallel", 1),
        context_parallel=strategy.get("context_parallel", 1),
        zero_stage=strategy.get("zero_stage", 0),
        activation_checkpointing=strategy.get("activation_checkpointing"),
        activation_compression=strategy.get("activation_compression"),
        activation_offload=strategy.get("activation_offload", False),
        micro_batch_size=BATCH // micro_batches,
        sequence_length=SEQ_LEN,
        optimizer=optimizer,
    )


def _coordinates(layout: Layout, rank: int) -> tuple[int, int, int]:
    """(pp rank, tp rank, dp rank) of global rank ``rank``: tp innermost, pp outermost (mesh/parallel_dims.py)."""
    tp, dp = layout.tensor_parallel, layout.data_parallel
    return rank // (tp * dp), rank % tp, (rank // tp) % dp


def _predicted(name: str, layout: Layout | None = None) -> tuple[Layout, list[RankMemory]]:
    family, overrides, strategy = LAYOUTS[name]
    optimizer = "adamw" if overrides.get("optimizer") == "adamw" else "sgd"
    module = build(family, **overrides)
    if name == "auto":  # what HybridParallelStrategy.auto chose in the script, chosen again here
        chosen, _ = choose_layout(module, 2, BATCH, SEQ_LEN, cluster=tiny_cluster(), precision="32-true")
        layout = layout or replace(chosen.layout, optimizer=optimizer)
    layout = layout or _layout(strategy, optimizer)
    return layout, rank_memory(module, layout, distinct=False)


def _for_rank(layout: Layout, ranks: list[RankMemory], rank: int) -> RankMemory:
    pp_rank, tp_rank, dp_rank = _coordinates(layout, rank)
    dp_rank = dp_rank if layout.zero_stage else 0
    return next(r for r in ranks if (r.pp_rank, r.tp_rank, r.dp_rank) == (pp_rank, tp_rank, dp_rank))


@pytest.mark.timeout(900)
def test_predicted_memory_equals_what_each_rank_holds(tmp_path: Path) -> None:
    measured = launch_for_results("planner_memory.py", tmp_path)
    for name in LAYOUTS:
        layout, ranks = _predicted(name)
        degrees = {"pp": layout.pipeline_parallel, "dp": layout.data_parallel, "tp": layout.tensor_parallel}
        assert all(results[name]["degrees"] == degrees for results in measured), (name, degrees)
        deepspeed = layout.zero_stage > 0 and layout.expert_parallel == 1
        for rank, results in enumerate(measured):
            held, predicted = results[name], _for_rank(layout, ranks, rank)
            where = f"{name} rank {rank}"
            assert held["parameters"] == predicted.parameters, (where, held, predicted)
            assert held["optimizer"] == predicted.optimizer, (where, held, predicted)
            if not deepspeed:  # DeepSpeed keeps reduced gradients in its own buckets, freed by its step
                assert held["gradients"] == predicted.gradients, (where, held, predicted)
            # Nothing of a step's saved tensors outlives it but the batch's token ids and targets (the loop holds
            # the batch). Before: a tensor kept with its grad_fn outlived the zero-bubble schedules' weight pass,
            # and sequence parallelism's slices (memory/regather.py) outlived their backward, until the next step.
            assert max(held["alive_after_step"]) <= 2 * BATCH * SEQ_LEN * 8, (where, held["alive_after_step"])
            steps, in_flight = layout.micro_batches, predicted.in_flight
            # the first step also discovers; what waits in host memory (activation_offload) is not the device's
            total, peak = held["activations"][-1] - held["offloaded"][-1], held["activation_peaks"][-1]
            per_micro_batch = predicted.activations_per_micro_batch
            # A later stage's input is its receive buffer, saved by the first block: one per micro-batch, made when
            # its receive is posted and let go after its backward (pipeline/receive_buffers.py).
            if layout.expert_parallel > 1 or name in ROUTED_UNDER_SP:
                assert total == pytest.approx(per_micro_batch, rel=EXPERT_RANK_TOLERANCE), (
                    where,
                    held,
                    predicted,
                )
                continue
            assert total == pytest.approx(per_micro_batch * steps, rel=ACTIVATION_TOLERANCE), (
                where,
                held,
                predicted,
            )
            # two stages a rank (no recomputation): each stage's micro-batches held at the peak, walked on torch's list
            at_peak = (
                predicted.activations if layout.pipeline_virtual_stages > 1 else per_micro_batch * in_flight
            )
            saver = layout.activation_compression is not None or layout.activation_offload
            if not saver:
                assert peak == pytest.approx(at_peak, rel=ACTIVATION_TOLERANCE), (where, held, predicted)
                continue
            # stored compressed or in host memory: the counter's peak follows the originals. Negative control: the
            # planner without the saver misses the device's bytes
            _, plain = _predicted(
                name, replace(layout, activation_compression=None, activation_offload=False)
            )
            # (under selective recomputation the kept outputs stay on the device: the saver moves only the block
            # inputs, 4% here, and the host bytes below are the check)
            if layout.activation_checkpointing != "selective":
                assert total != pytest.approx(_for_rank(layout, plain, rank).activations_per_micro_batch * steps,
                                              rel=ACTIVATION_TOLERANCE), where  # fmt: skip
            host = predicted.activations_host_per_micro_batch * steps
            assert held["offloaded"][-1] == pytest.approx(host, rel=ACTIVATION_TOLERANCE), (
                where,
                held,
                predicted,
            )
            assert (host > 0) == layout.activation_offload, where

        if layout.expert_parallel > 1 or name in ROUTED_UNDER_SP:
            mean = sum(results[name]["activations"][-1] for results in measured) / len(measured)
            expected = _for_rank(layout, ranks, 0).activations_per_micro_batch
            assert mean == pytest.approx(expected, rel=EXPERT_MEAN_TOLERANCE), (name, mean, expected)

    # Negative controls: the other schedule's peak, and a plan for the wrong degree, miss.
    gpipe, ranks = _predicted("pp2_gpipe", replace(_predicted("pp2_gpipe")[0], pipeline_schedule="1f1b"))
    first = _for_rank(gpipe, ranks, 0)
    assert (
        measured[0]["pp2_gpipe"]["activation_peaks"][-1]
        > 1.5 * first.activations_per_micro_batch * first.in_flight
    )
    # ... and interleaved 1F1B's warm-up spread evenly over the rank's two stages (the planner before) misses rank 0
    interleaved, ranks = _predicted("pp2_interleaved_1f1b")
    p, v = interleaved.pipeline_parallel, interleaved.pipeline_virtual_stages
    warmup = (v - 1) * p + 2 * (p - 1) + 1  # rank 0's chunk-forwards in flight
    even = -(-warmup // v) * _for_rank(interleaved, ranks, 0).activations_per_micro_batch
    assert even > 1.15 * measured[0]["pp2_interleaved_1f1b"]["activation_peaks"][-1]
    tp_layout, _ = _predicted("tp2_sp")
    _, wrong = _predicted(
        "tp2_sp", replace(tp_layout, tensor_parallel=1, sequence_parallel=False, data_parallel=2)
    )
    assert measured[0]["tp2_sp"]["parameters"] != wrong[0].parameters
