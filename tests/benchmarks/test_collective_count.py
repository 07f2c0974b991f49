"""Tensor parallelism communicates exactly Megatron's minimum inside every transformer layer.

Two gloo processes train the recipe GPT at ``tensor_parallel=2`` (without and with sequence
parallelism; and with ``loss_parallel=True``, where the whole step must be the minimum) and
record every collective of one training step (``benchmarks.tp_collectives``, which also
derives the minimum). Counted, never timed: the counts and sizes are deterministic.
"""

from __future__ import annotations

import pytest

from benchmarks.tp_collectives import BATCH, SHAPE, WITHOUT_CLIP, measure, megatron_minimum, summarize

LOSS_PARALLEL_NO_SP = (False, False, True)  # (sequence_parallel, clip, loss_parallel)


@pytest.fixture(scope="module")
def launch_results() -> list[dict]:
    # One launch for all layouts: process start-up is most of the cost.
    return measure((*WITHOUT_CLIP, LOSS_PARALLEL_NO_SP), timeout_s=170)


@pytest.fixture(scope="module")
def results(launch_results: list[dict]) -> dict[bool, dict]:
    """The default layouts (logits gathered), by ``sequence_parallel``."""
    return {r["sequence_parallel"]: r for r in launch_results if not r["loss_parallel"]}


@pytest.fixture(scope="module")
def loss_parallel_result(launch_results: list[dict]) -> dict:
    """tp=2 without SP and with ``loss_parallel=True``: the logits stay sharded over the vocabulary."""
    return next(r for r in launch_results if r["loss_parallel"])


def _listing(events: list[dict], layer: str) -> str:
    return "\n".join(f"  {e['phase']} {e['kind']} {e['elements']} at {e['where']} ({e['source']})"
                     for e in events if e["where"] == layer or e["where"].startswith(layer + "."))  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_every_layer_communicates_the_megatron_minimum(
    results: dict[bool, dict], sequence_parallel: bool
) -> None:
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
        assert sum(got.values()) == (10 if sequence_parallel else 4)  # sp: the entries' inputs gathered again


@pytest.mark.timeout(180)
def test_whole_step_is_the_megatron_minimum_with_loss_parallel(loss_parallel_result: dict) -> None:
    per_layer, per_category = summarize(loss_parallel_result["events"], loss_parallel_result["block_names"])
    want = megatron_minimum(False, clip=False)
    assert all(got == want["layer"] for got in per_layer)
    for category in ("embedding", "final norm + head", "loss", "optimizer step"):
        assert per_category[category] == want[category], (
            f"{category}: measured {dict(per_category[category])}, Megatron minimum {dict(want[category])}"
        )
    assert not per_category.get("other"), f"unexpected collectives: {dict(per_category['other'])}"
