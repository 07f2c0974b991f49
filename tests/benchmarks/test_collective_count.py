"""Tensor parallelism communicates exactly Megatron's minimum inside every transformer layer.

Two gloo processes train the recipe GPT at ``tensor_parallel=2`` (without and with sequence
parallelism) and record every collective of one training step (``benchmarks.tp_collectives``,
which also derives the minimum). Counted, never timed: the counts and sizes are deterministic.
"""

from __future__ import annotations

import pytest

from benchmarks.tp_collectives import BATCH, SHAPE, WITHOUT_CLIP, measure, megatron_minimum, summarize


@pytest.fixture(scope="module")
def results() -> dict[bool, dict]:
    # One launch for both layouts: process start-up is most of the cost.
    return {result["sequence_parallel"]: result for result in measure(WITHOUT_CLIP, timeout_s=170)}


def _listing(events: list[dict], layer: str) -> str:
    return "\n".join(f"  {e['phase']} {e['kind']} {e['elements']} at {e['where']} ({e['source']})"
                     for e in events if e["where"] == layer or e["where"].startswith(layer + "."))  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_every_layer_communicates_the_megatron_minimum(results: dict[bool, dict], sequence_parallel: bool) -> None:
    result = results[sequence_parallel]
    per_layer, _ = summarize(result["events"], result["block_names"])
    want = megatron_minimum(sequence_parallel, clip=False)["layer"]
    assert len(per_layer) == SHAPE["n_layer"]
    activation = BATCH * SHAPE["block_size"] * SHAPE["n_embd"]
    assert all(elements == activation for _, _, elements in want)
    for index, got in enumerate(per_layer):
        block = result["block_names"][index]
        # Counter equality: the same collectives, each as often, of the same size (so the same bytes),
        # in the same phase (forward / backward).
        assert got == want, (
            f"layer {index} (sequence_parallel={sequence_parallel}): measured {dict(got)},"
            f" Megatron minimum {dict(want)}. Collectives:\n{_listing(result['events'], block)}"
        )
        assert sum(got.values()) == (8 if sequence_parallel else 4)
