"""The final norm, the head and the loss on each rank's tokens equal the one-process step, loss and gradients.

On 2 gloo ranks, for training-step code after the block stack as users write it (nanoGPT's reshape and
``F.cross_entropy``; Hugging Face's RMSNorm, ``hidden[:, slice(0, None)]``, ``.float()`` and its summed loss
over shifted labels; label smoothing; ``log_softmax`` and ``F.nll_loss``; per-token losses reduced by the
step; reshapes by the logits' own ``shape`` with a soft cap): the loss and every gradient (hidden state,
norm, head) match the reference within 1e-5, with the loss computed on this rank's tokens and nothing
gathered. Steps that need the whole sequence (a shift written on the logits, a z-loss's mean over tokens
with an accuracy, an assignment into the logits, class weights) still match, through the gather, and say
which function needed it.

Negative control: the same step on a split hidden state with each rank's own targets, without the
follower (each rank's mean over its tokens), misses the reference's loss.
"""

from __future__ import annotations

import pytest

from tests.context_parallel import local_tokens_workers
from tests.experts.spawn import run_ranks

pytestmark = [pytest.mark.distributed]

ON_TOKENS = ["nanogpt", "hugging_face", "smoothed", "nll", "per_token", "whole_shapes"]
GATHERING = {
    "shifted": {"__getitem__"},
    "z_loss_and_accuracy": {"mean", "__eq__"},
    "masked_in_place": {"__setitem__", "view"},
    "weighted": {"cross_entropy"},
}
CONTROLS = ["nanogpt", "hugging_face"]


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, bool], list[dict]]:
    settings = [(name, True) for name in [*ON_TOKENS, *GATHERING]] + [(name, False) for name in CONTROLS]
    per_rank = run_ranks(local_tokens_workers.compare_all, 2, (settings,), timeout_s=240)
    return {s: [rank[i] for rank in per_rank] for i, s in enumerate(settings)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ON_TOKENS)
def test_loss_on_each_ranks_tokens_equals_the_whole_sequence_step(outcomes: dict, name: str) -> None:
    for rank, outcome in enumerate(outcomes[(name, True)]):
        assert outcome["loss_close"] and outcome["grads_close"], f"rank {rank}: {outcome}"
        assert outcome["local_losses"] == 1 and outcome["gathered"] == [], f"rank {rank}: {outcome}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(GATHERING))
def test_steps_that_need_the_whole_sequence_gather_it_and_match(outcomes: dict, name: str) -> None:
    for rank, outcome in enumerate(outcomes[(name, True)]):
        assert outcome["loss_close"] and outcome["grads_close"], f"rank {rank}: {outcome}"
        assert GATHERING[name] <= set(outcome["gathered"]), f"rank {rank}: {outcome}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CONTROLS)
def test_each_ranks_own_mean_misses_the_reference(outcomes: dict, name: str) -> None:
    """The negative control: the comparison tells a loss over this rank's tokens alone from the step's loss."""
    losses = outcomes[(name, False)]
    assert not any(o["loss_close"] for o in losses), losses
    assert max(abs(o["loss"] - o["reference"]) for o in losses) > 1e-3, losses
