"""The final norm, the head and the loss on each rank's tokens equal the one-process step, loss and gradients.

On 2 gloo ranks, for training-step code after the block stack as users write it (nanoGPT's reshape and
``F.cross_entropy``; Hugging Face's RMSNorm, ``hidden[:, slice(0, None)]``, ``.float()`` and its summed loss
over shifted labels; label smoothing; ``log_softmax`` and ``F.nll_loss``; per-token losses reduced by the
step; reshapes by the logits' own ``shape`` with a soft cap): the loss and every gradient (hidden state,
norm, head) match the reference within 1e-5, with the loss computed on this rank's tokens and nothing
gathered; so do a write into the logits that keeps each token to itself (through a view taken before) and a
custom autograd function (its forward sees the sizes of the storage it is given). Steps that need the whole
sequence (a shift written on the logits, a z-loss's mean over tokens with an accuracy, a metric under
``no_grad`` before the loss, class weights) still match, through the gather, and say which function needed
it. A write at a sequence position (it would mix tokens across ranks) is refused with a clear error.

Negative control: the same step on a split hidden state with each rank's own targets, without the
follower (each rank's mean over its tokens), misses the reference's loss.
"""

from __future__ import annotations

import pytest

from tests.context_parallel import local_tokens_workers
from tests.experts.spawn import run_ranks

pytestmark = [pytest.mark.distributed]

ON_TOKENS = ["nanogpt", "hugging_face", "smoothed", "nll", "per_token", "whole_shapes", "masked_in_place",
             "custom_function"]  # fmt: skip
GATHERING = {
    "shifted": {"__getitem__"},
    "z_loss_and_accuracy": {"mean", "__eq__"},
    "logged_without_grad": {"__getitem__"},
    "weighted": {"cross_entropy"},
}
CONTROLS = ["nanogpt", "hugging_face"]


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, bool], list[dict]]:
    settings = [(name, True) for name in [*ON_TOKENS, *GATHERING, "position_write"]]
    settings += [(name, False) for name in CONTROLS]
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


@pytest.mark.timeout(300)
def test_a_custom_function_reads_the_shape_of_the_storage_it_is_given(outcomes: dict) -> None:
    """Inside a custom autograd function's forward (grad off: a fused kernel sized by ``x.shape``), the sizes are this
    rank's, as the storage holds them; the step's own code sees the whole sequence's (``whole_shapes``)."""
    local = local_tokens_workers.T // 2
    for outcome in outcomes[("custom_function", True)]:
        assert outcome["function_saw"] == (local_tokens_workers.B, local, local_tokens_workers.V), outcome


@pytest.mark.timeout(300)
def test_an_in_place_write_that_mixes_tokens_is_refused(outcomes: dict) -> None:
    for outcome in outcomes[("position_write", True)]:
        assert "changes, in place with `__setitem__`" in outcome.get("refused", ""), outcome
