"""Our DeviceMesh, described to DeepSpeed as a Megatron-style ``mpu`` object.

DeepSpeed asks an ``mpu`` which ranks ZeRO shards over (the data-parallel group), which ranks
hold different slices of the model (the model-parallel group: pipeline stages x tensor shards,
over which the gradient norm and the fp16 overflow flag are summed / maxed), and the
tensor-parallel rank (parameters not split by tensor parallelism are counted in the norm on
tensor rank 0 only). The answers come from the one mesh the strategy built, so ZeRO's groups
are the strategy's groups.

With expert parallelism ZeRO shards over the expert-data-parallel ranks (``dp_replicate``), and
``ep`` joins the "tensor" axis for DeepSpeed: expert slices differ across it as tensor shards do,
while a dense weight is the same on every ``ep`` rank and is counted once in the norm.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.compat import flatten_mesh
from lightning_parallel.mesh import Axis


class MeshParallelUnit:
    """The ``mpu`` interface DeepSpeed queries, answered from a ``("pp", ..., "dp", "tp")`` mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self._mesh = mesh
        self._pp = mesh[Axis.PP]
        # Every rank takes part in creating the flattened groups (a collective), also when a
        # group has one member.
        if _has_axis(mesh, Axis.EP):
            self._dp = mesh[Axis.DP_REPLICATE]
            self._tp = _flat(mesh, (Axis.EP, Axis.TP))
            self._mp = _flat(mesh, (Axis.PP, Axis.EP, Axis.TP))
        else:
            self._dp = mesh[Axis.DP]
            self._tp = mesh[Axis.TP]
            self._mp = _flat(mesh, (Axis.PP, Axis.TP))  # same data-parallel index, any stage and shard

    # data parallel (what ZeRO shards over)
    def get_data_parallel_group(self) -> Any:
        return self._dp.get_group()

    def get_data_parallel_world_size(self) -> int:
        return self._dp.size()

    def get_data_parallel_rank(self) -> int:
        return self._dp.get_local_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    # model parallel = pipeline x tensor
    def get_model_parallel_group(self) -> Any:
        return self._mp.get_group()

    def get_model_parallel_world_size(self) -> int:
        return self._mp.size()

    def get_model_parallel_rank(self) -> int:
        return self._mp.get_local_rank()

    # tensor parallel
    def get_tensor_model_parallel_group(self) -> Any:
        return self._tp.get_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._tp.size()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._tp.get_local_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self.get_tensor_model_parallel_group())[0]

    # pipeline
    def get_pipeline_model_parallel_group(self) -> Any:
        return self._pp.get_group()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._pp.size()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._pp.get_local_rank()

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank


def _has_axis(mesh: DeviceMesh, name: Axis) -> bool:
    """Whether ``mesh`` names ``name``: an axis of its own, or one flattened from others (``ep`` beside ``cp``)."""
    try:
        mesh[name]
    except KeyError:
        return False
    return True


def _flat(mesh: DeviceMesh, axes: tuple[Axis, ...]) -> DeviceMesh:
    name = "_".join(axes)
    try:
        return mesh[name]
    except (KeyError, NotImplementedError):
        # Not flattened yet (KeyError), or torch 2.11, which cannot slice a flattened axis whose parts are
        # not adjacent (``pp_tp`` beside ``dp``) and raises NotImplementedError: its ``_flatten`` returns
        # the mesh it made the first time.
        return flatten_mesh(mesh, axes, name)
