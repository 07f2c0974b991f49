"""Issue 34's memory terms gone, counted in bytes on two CPU ranks, and the planner matching what is held now.

One launch (``scripts/memory_terms.py``) trains the recipe GPT with each term switched off (before) and on
(after), at two sizes of what the term grows with; per rank it records the saved-tensor counter (peak and
total of one step), the bytes the pipeline receive buffers hold, and the peak of every storage the step made
(an allocator's view, on the CPU). Exact where the term is exact:

- 16-bit weight copies (pp2 GPipe, bf16-mixed, M = 2, 4): before holds M copies of the stage's matmul weights
  more than after, to the byte; after, the planner's activations are within 5% and its prediction misses the
  before by more; the allocator's peak falls too, by more at M = 4.
- receive buffers (pp2 1F1B, fp32, M = 2, 4): before M hidden states per stage, after the one the schedule
  has in flight whatever M, equal to the planner's buffers;
- the loss (tp2, bf16-mixed, vocabulary 128, 256): before keeps fp32 log-probabilities over the whole
  vocabulary (4 bytes per token and word of it), after the rank's half of the bf16 logits (1 byte per token and
  word), within 5% of the planner's loss term, and the planner's activations within 5% of the count.

- the gathered inputs (tp2 + sp, bf16-mixed, batches of 2 and 4): before each block's two entry inputs whole,
  after this rank's half of each, the planner within 5% of the after.
- the sends of the multi-stage schedules (pp2 interleaved 1F1B, fp32, M = 4, 8): before every send kept to the
  step's end (the peak grows three hidden states a micro-batch), after a stage's outputs gone with its backward.

Counted, never timed.
"""

from __future__ import annotations

import pytest

from lightning_parallel.planner.activations import loss_bytes_per_token
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.memory import RankMemory, rank_memory
from lightning_parallel.planner.shapes import describe
from tests.models.families import SEQ_LEN, build
from tests.strategy import launch_for_results

pytestmark = [pytest.mark.distributed]
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return launch_for_results("memory_terms.py", tmp_path_factory.mktemp("memory_terms"), timeout_s=500)


def _planned(vocab: int = 128, layers: int = 4, **layout: object) -> list[RankMemory]:
    model = build("recipe_gpt", vocab_size=vocab, n_layer=layers)
    full = Layout(sequence_length=SEQ_LEN, optimizer="sgd", **layout)  # type: ignore[arg-type]
    return rank_memory(model, full, describe(model), distinct=False)


def _stage_weight_bytes(rank: int) -> int:
    """16-bit bytes of the matmul weights pipeline rank ``rank`` multiplies by (blocks; the last: the head)."""
    model = build("recipe_gpt", n_layer=4).model
    blocks = list(model.transformer.h)[2 * rank : 2 * rank + 2]
    weights = sum(
        p.numel() for b in blocks for n, p in b.named_parameters() if n.endswith("weight") and p.dim() == 2
    )
    head = model.lm_head.weight.numel() if rank == 1 else 0
    return 2 * (weights + head)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_no_weight_copy_is_held_per_micro_batch(held: list[dict], micro_batches: int) -> None:
    planned = _planned(pipeline_parallel=2, micro_batches=micro_batches, pipeline_schedule="gpipe",
                       precision="bf16-mixed")  # fmt: skip
    for rank, results in enumerate(held):
        before, after = results[f"casts_M{micro_batches}_before"], results[f"casts_M{micro_batches}_after"]
        assert before["peak"] - after["peak"] == micro_batches * _stage_weight_bytes(rank), (
            rank,
            before,
            after,
        )
        predicted = planned[rank].activations
        assert after["peak"] == pytest.approx(predicted, rel=TOLERANCE), (rank, after, predicted)
        assert before["peak"] != pytest.approx(predicted, rel=TOLERANCE)  # the negative control
        assert after["allocator_peak"] < before["allocator_peak"], (rank, before, after)
    for rank, results in enumerate(held):  # the allocator's saving grows with the copies left out
        saved = {m: results[f"casts_M{m}_before"]["allocator_peak"] - results[f"casts_M{m}_after"]["allocator_peak"]
                 for m in (2, 4)}  # fmt: skip
        assert saved[4] > saved[2] > 0, (rank, saved)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_receive_buffers_are_those_in_flight(held: list[dict], micro_batches: int) -> None:
    planned = _planned(pipeline_parallel=2, micro_batches=micro_batches, precision="32-true")
    hidden = SEQ_LEN * 64 * 4  # one sequence's fp32 hidden state: a micro-batch
    for rank, results in enumerate(held):
        before, after = (
            results[f"buffers_M{micro_batches}_before"],
            results[f"buffers_M{micro_batches}_after"],
        )
        assert before["buffers"] == micro_batches * hidden  # torch's: one per micro-batch
        assert after["buffers"] == hidden == planned[rank].buffers  # 1F1B: one in flight on either stage
        assert before["buffers"] != planned[rank].buffers  # the negative control


@pytest.mark.timeout(600)
@pytest.mark.parametrize("vocab", [128, 256])
def test_the_loss_keeps_the_rank_s_shard_of_the_logits(held: list[dict], vocab: int) -> None:
    tokens = 4 * SEQ_LEN
    layout = {"tensor_parallel": 2, "precision": "bf16-mixed", "micro_batch_size": 4}
    planned = _planned(vocab, 2, **layout)
    model = describe(build("recipe_gpt", vocab_size=vocab))
    sharded = loss_bytes_per_token(model, Layout(**layout)) * tokens  # type: ignore[arg-type]
    whole = loss_bytes_per_token(model, Layout(loss_parallel=False, **layout)) * tokens  # type: ignore[arg-type]
    assert whole == tokens * vocab * 4 and sharded < whole / 3
    for rank, results in enumerate(held):
        before, after = results[f"loss_V{vocab}_before"], results[f"loss_V{vocab}_after"]
        assert before["total"] - after["total"] == pytest.approx(whole - sharded, rel=TOLERANCE), (
            rank,
            before,
            after,
        )
        assert after["total"] == pytest.approx(planned[rank].activations, rel=TOLERANCE), (rank, after)
        assert before["total"] != pytest.approx(planned[rank].activations, rel=TOLERANCE)  # negative control
        assert after["allocator_peak"] < before["allocator_peak"]
    growth = {
        k: held[0][f"loss_V256_{k}"]["total"] - held[0][f"loss_V128_{k}"]["total"]
        for k in ("before", "after")
    }
    assert growth == {"before": tokens * 128 * 4, "after": tokens * 64 * 2}  # 128 more words: whole vs shard


@pytest.mark.timeout(600)
@pytest.mark.parametrize("batch", [2, 4])
def test_gathered_inputs_are_held_as_the_rank_s_slice(held: list[dict], batch: int) -> None:
    """tp2 + sp, bf16-mixed: each block's two gathered entry inputs (q|k|v's, the MLP's: one bf16 copy each)
    held as half of themselves; the planner, which counts the slice, within 5% of what is held."""
    tokens, width, layers, tp = batch * SEQ_LEN, 64, 2, 2
    gathered = 2 * layers * tokens * width * 2  # bytes of the whole bf16 inputs
    planned = _planned(tensor_parallel=2, sequence_parallel=True, precision="bf16-mixed", micro_batch_size=batch,
                       layers=layers)  # fmt: skip
    for rank, results in enumerate(held):
        before, after = results[f"regather_B{batch}_before"], results[f"regather_B{batch}_after"]
        assert before["total"] - after["total"] == gathered - gathered // tp, (rank, before, after)
        assert after["total"] == pytest.approx(planned[rank].activations, rel=TOLERANCE), (rank, after)
        assert before["total"] != pytest.approx(planned[rank].activations, rel=TOLERANCE)  # negative control


@pytest.mark.timeout(600)
def test_a_stage_s_sent_outputs_go_with_its_backward(held: list[dict]) -> None:
    """pp2 interleaved 1F1B (two stages a rank), fp32, M = 4 and 8: torch's runtime keeps every send until the
    step ends, three hidden states a micro-batch on either rank (rank 0: the outputs of stages 0 and 2 and the
    input gradient of stage 2; rank 1: stage 1's output and the input gradients of stages 1 and 3), so the peak
    grows with M (the negative control). With the sends let go once known complete (``pipeline/send_release.py``),
    the outputs go at their stage's backward: on gloo, whose sends report completion only once waited on, the
    input gradients still stay to the step's end (on NCCL they go as they complete)."""
    hidden = SEQ_LEN * 64 * 4
    for rank, results in enumerate(held):
        growth = {k: results[f"sends_M8_{k}"]["allocator_peak"] - results[f"sends_M4_{k}"]["allocator_peak"]
                  for k in ("before", "after")}  # fmt: skip
        assert growth["before"] >= 4 * 3 * hidden, (rank, growth)  # three sends a micro-batch kept
        assert growth["after"] <= growth["before"] - 4 * hidden, (rank, growth)  # at least the outputs go
        assert results["sends_M8_after"]["sends_released"] > 0 == results["sends_M8_before"]["sends_released"]
        for m in (4, 8):
            assert (
                results[f"sends_M{m}_after"]["peak"] == results[f"sends_M{m}_before"]["peak"]
            )  # same saved tensors
