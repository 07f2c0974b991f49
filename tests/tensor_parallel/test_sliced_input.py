"""A projection of the heads' values to one output per head (Doge's ``dt_proj``), as wide as the hidden state
in its configs: under tensor parallelism it is fed the rank's slice of the values (gathered first) and,
where it reads the hidden state, the whole of it; both give this rank's heads' outputs of one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_parallel.tensor_parallel.styles import ColwiseProjection
from tests.precision import spawn_gloo

WIDTH, HEADS = 8, 4


def _values_then_hidden(rank: int, world_size: int, plain: bool) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = nn.Linear(WIDTH, HEADS)
    projection = nn.Linear(WIDTH, HEADS)
    projection.load_state_dict(reference.state_dict())
    sliced = None if plain else WIDTH // world_size  # the negative control: the plain column style
    parallelize_module(projection, mesh, ColwiseProjection(use_local_output=True, sliced_input_width=sliced))
    values = torch.randn(3, WIDTH)
    heads = slice(rank * HEADS // world_size, (rank + 1) * HEADS // world_size)
    piece = WIDTH // world_size
    local = projection(values[:, rank * piece : (rank + 1) * piece])  # this rank's heads' values
    torch.testing.assert_close(local, reference(values)[:, heads])
    torch.testing.assert_close(projection(values), reference(values)[:, heads])  # the whole hidden state


def test_a_projection_of_the_values_reads_the_rank_s_slice_or_the_whole() -> None:
    spawn_gloo(_values_then_hidden, 2, False)


def test_negative_control_the_plain_column_style_cannot_read_a_slice() -> None:
    with pytest.raises(Exception, match="size|shape|dim|mismatch"):
        spawn_gloo(_values_then_hidden, 2, True)
