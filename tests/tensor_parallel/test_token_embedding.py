"""The vocabulary-parallel embedding hands the model a tensor of its own: model code that scales the embedding
in place (CTRL's ``inputs_embeds *= sqrt(d)``) trains as in one process; a plain ``RowwiseParallel`` output,
a view made by a custom autograd function, cannot be modified in place."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from lightning_parallel.tensor_parallel.styles import TokenEmbedding
from tests.precision import spawn_gloo


def _scaled_in_place(rank: int, world_size: int, plain: bool) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = nn.Embedding(16, 8)
    sharded = parallelize_module(
        copy.deepcopy(reference), mesh,
        (RowwiseParallel if plain else TokenEmbedding)(input_layouts=Replicate(), output_layouts=Replicate()),
    )  # fmt: skip
    ids = torch.tensor([[1, 9, 15, 3]])
    outputs = []
    for module in (reference, sharded):
        out = module(ids)
        out *= 8**0.5  # what CTRL does to its embedding
        out.sum().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[1], outputs[0])
    torch.testing.assert_close(sharded.weight.grad.full_tensor(), reference.weight.grad)


def test_an_embedding_scaled_in_place_trains_as_in_one_process() -> None:
    spawn_gloo(_scaled_in_place, 2, False)


def test_negative_control_the_plain_style_s_view_refuses_the_in_place_scale() -> None:
    with pytest.raises(Exception, match="modified inplace"):
        spawn_gloo(_scaled_in_place, 2, True)
