"""A norm of an MLP's hidden units (``GatheredNorm``) also applied where its width is the model's (ERGO's
shared expert normalises its exit's output, and its hidden width equals the model width): a sharded input is
gathered and cut back, a whole one normalised as it is; both match one process, values and the weight's
gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_parallel.tensor_parallel.norm_styles import GatheredNorm
from tests.precision import spawn_gloo

WIDTH = 8


def _both_widths(rank: int, world_size: int, as_before: bool) -> None:
    from unittest import mock

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = nn.RMSNorm(WIDTH)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    norm = nn.RMSNorm(WIDTH)
    norm.load_state_dict(reference.state_dict())
    gathered = GatheredNorm._gather
    if as_before:  # the negative control: every input taken for a shard of the features

        def gathered(dim, module, inputs, mesh):  # noqa: ANN001, ANN202
            from torch.distributed.tensor import DTensor, Replicate, Shard

            x = DTensor.from_local(inputs[0], mesh, [Shard(dim % inputs[0].dim())], run_check=False)
            module.__dict__["_lp_gathered"] = True
            return (x.redistribute(mesh, [Replicate()]),)

    with mock.patch.object(GatheredNorm, "_gather", staticmethod(gathered)):
        parallelize_module(norm, mesh, GatheredNorm())
    x = torch.randn(3, WIDTH)
    piece = WIDTH // world_size
    sharded = norm(x[:, rank * piece : (rank + 1) * piece])  # the hidden units, split
    torch.testing.assert_close(sharded, reference(x)[:, rank * piece : (rank + 1) * piece])
    whole = norm(x)  # the exit's output, replicated
    torch.testing.assert_close(whole, reference(x))
    whole.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(norm.weight.grad.full_tensor(), reference.weight.grad)


def test_a_gathered_norm_normalises_a_whole_input_as_it_is() -> None:
    spawn_gloo(_both_widths, 2, False)


def test_negative_control_a_whole_input_taken_for_a_shard_is_gathered_twice() -> None:
    with pytest.raises(Exception, match="size|shape|Mismatched|not close"):
        spawn_gloo(_both_widths, 2, True)
