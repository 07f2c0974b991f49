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


class _Mesh:
    """What the cut reads of a mesh when the tensor needs no gradient: its size and this rank."""

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 1


def test_a_heads_first_bias_is_cut_along_its_first_dimension() -> None:
    """MPT's ALiBi, ``(heads, 1, positions)``, made at model level: rank 1 of 2 gets heads 2-3. Told from a
    ``(batch, ...)`` tensor by its size; where batch equals heads the size cannot tell (None), and the cut
    follows what the same argument was on an earlier call (``heads_first``)."""
    from lightning_parallel.tensor_parallel.regions import is_heads_first

    alibi = torch.randn(HEADS, 1, 32)
    assert is_heads_first(alibi, BATCH, HEADS) is True
    assert is_heads_first(alibi, HEADS, HEADS) is None
    assert is_heads_first(torch.randn(1, HEADS, 1, 32), BATCH, HEADS) is False  # (1, heads, ...): dim 1
    assert is_heads_first(torch.randn(BATCH, 32, 16), BATCH, HEADS) is False  # rotary tables and the like
    cut = local_heads(alibi, BATCH, HEADS, _Mesh(), heads_first=True)  # type: ignore[arg-type]
    assert torch.equal(cut, alibi[2:])
    # the negative control: not known as heads-first, it stays whole (and the attention's shapes disagree)
    assert local_heads(alibi, BATCH, HEADS, _Mesh(), heads_first=False) is alibi  # type: ignore[arg-type]


def _returned_parameter_gradient(rank: int, world_size: int, as_before: bool) -> None:
    """A module hands one of its whole parameters back to its caller (GPT-NeoX-Japanese's ``dense_bias``),
    which adds it after the reduction, on replicated activations: its gradient is the whole one on every
    rank, not a share to be summed over the ranks."""
    from unittest import mock

    from torch import nn

    from lightning_parallel.tensor_parallel import param_styles

    class ReturnsItsBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.full((4,), 2.0))
            self.bias = nn.Parameter(torch.arange(4.0))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.scale, self.bias

    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.arange(12.0).view(3, 4)
    reference = ReturnsItsBias()
    out, bias = reference(x)
    (out + bias).pow(2).sum().backward()
    module = ReturnsItsBias()
    handing_back = param_styles._restore if as_before else param_styles._restore_handing_back_whole
    with mock.patch.object(param_styles, "_restore_handing_back_whole", handing_back):
        param_styles.LocalParameters({"bias": None}, returned_whole=True)._apply(module, mesh)
    out, bias = module(x)
    (out + bias).pow(2).sum().backward()
    torch.testing.assert_close(module.bias.grad.full_tensor(), reference.bias.grad)


def test_a_whole_parameter_the_module_returns_gets_the_whole_gradient() -> None:
    spawn_gloo(_returned_parameter_gradient, 2, False)


def test_negative_control_a_returned_parameter_summed_as_a_share_is_counted_twice() -> None:
    with pytest.raises(Exception, match="Mismatched elements|not close"):
        spawn_gloo(_returned_parameter_gradient, 2, True)
