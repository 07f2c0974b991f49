"""A learned attention bias made once at model level and cut to each rank's heads (CPM-Ant's relative-position
bias; ALiBi is the same cut without a gradient): the weights that made it must get the whole gradient on every
tensor-parallel rank, not only the gradient of that rank's heads (their copies would drift apart)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from lightning_parallel.tensor_parallel.regions import local_heads
from tests.precision import spawn_gloo

HEADS, BATCH, SEQ = 4, 2, 3


def _bias_gradient(rank: int, world_size: int, detach_cut: bool) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    table = torch.randn(
        HEADS, SEQ, SEQ, requires_grad=True
    )  # the model-level weights, the same on every rank
    weights = torch.randn(BATCH, HEADS, SEQ, SEQ)  # what the attention makes of each head's bias
    bias = table.unsqueeze(0).expand(BATCH, -1, -1, -1)
    size = HEADS // world_size
    mine = weights[:, rank * size : (rank + 1) * size]
    cut = local_heads(bias.detach() if detach_cut else bias, BATCH, HEADS, mesh)
    assert cut.shape == (BATCH, size, SEQ, SEQ)
    torch.testing.assert_close(cut, bias[:, rank * size : (rank + 1) * size])
    if (
        detach_cut
    ):  # the negative control: a cut that only narrows (ALiBi's, no gradient) gives this rank's part
        cut = bias.narrow(1, rank * size, size)
    (cut * mine).sum().backward()
    # One process: the loss sums every head's bias times its weights; the table's gradient is their sum over
    # the batch, every head included.
    torch.testing.assert_close(table.grad, weights.sum(0))


def test_a_learned_bias_gets_the_whole_gradient_on_every_rank() -> None:
    spawn_gloo(_bias_gradient, 2, False)


def test_negative_control_a_narrowed_bias_gets_only_its_heads_gradient() -> None:
    with pytest.raises(Exception, match="Mismatched elements|not close"):
        spawn_gloo(_bias_gradient, 2, True)
