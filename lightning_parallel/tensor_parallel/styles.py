"""Tensor-parallel styles that torch's own styles do not cover, built on them.

torch's ``ColwiseParallel``/``RowwiseParallel`` accept only ``nn.Linear`` and ``nn.Embedding``
and shard a projection as one block. Unchanged models also contain:

- Hugging Face ``Conv1D`` (GPT-2): a linear layer with the weight stored transposed
  (``(in, out)``), so column parallelism shards dim 1 of its weight, not dim 0.
- Fused projections (``c_attn`` = q|k|v, ``gate_up``): a contiguous ``Shard(0)`` would give
  rank 0 all of q and half of k. Each rank needs its own slice of *every* chunk. torch's
  ``_StridedShard(dim, split_factor=k)`` is exactly that placement: the local tensor is
  ``[q_r; k_r; v_r]`` and ``full_tensor()`` still returns the user's original layout, so
  checkpoints and the consolidated state dict need no permutation. torch before 2.13 cannot run
  ``_StridedShard`` through ``F.linear`` and its redistributions (``lightning_parallel/compat.py``):
  there the same local rows are stored as a row layout (``tensor_parallel/row_layout.py``), plain
  ``Shard`` of the rows in another order, undone wherever the user's tensor is meant.

Everything else (input/output redistribution, autograd of the collectives) is torch's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from lightning_parallel.compat import StridedShard, strided_shard_in_ops
from lightning_parallel.tensor_parallel.row_layout import ROW_LAYOUT, RowLayout


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's transposed linear layer (``transformers.pytorch_utils.Conv1D``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def projection_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return int(module.nx), int(module.nf)
    raise TypeError(f"{type(module).__name__} is not a projection")


def sharded_dims(module: nn.Module, style: object) -> dict[str, int]:
    """``{own parameter name: tensor dim}`` that ``style`` shards on ``module``; absent names stay replicated.

    The one statement of where each style cuts (column parallel: the output features, row
    parallel: the input features, wherever the module stores them): the styles below partition
    by it, and sizes computed without processes (``python -m lightning_parallel plan``) read it.
    """
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if embedding else {"weight": 1 if is_conv1d(module) else 0, "bias": 0}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0 if embedding or is_conv1d(module) else 1}
    return {}


def _split_placement(dim: int, num_chunks: int) -> Placement:
    return Shard(dim) if num_chunks == 1 else StridedShard(dim, split_factor=num_chunks)


def fused_rows(rows: int, num_chunks: int, ranks: int) -> RowLayout:
    """The rows of a fused projection (``num_chunks`` equal parts) as a row layout: each rank stores its slice
    of every part, ``[q_r; k_r; v_r]``, the local tensor ``_StridedShard`` gives (for torch before 2.13)."""
    if rows % (num_chunks * ranks):
        raise ValueError(
            f"a fused projection of {rows} rows in {num_chunks} parts cannot be split over {ranks}"
            f" tensor-parallel ranks on torch {torch.__version__}: each part's {rows // num_chunks} rows must"
            f" divide by {ranks} (torch >= 2.13 also splits them unevenly)"
        )
    return RowLayout.of_blocks(
        [(rows // num_chunks, ranks)] * num_chunks, ranks, label=f"{num_chunks} fused parts"
    )


def _distribute_params(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int | None
) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, Replicate())
        dist_param = nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad,
        )
        module.register_parameter(name, dist_param)


class ColwiseProjection(ColwiseParallel):
    """Column parallelism for ``nn.Linear`` and ``Conv1D``, optionally of a fused projection.

    ``num_chunks > 1`` marks a projection whose output concatenates that many equal parts
    (fused q|k|v: 3). Its output stays in the local ``[q_r; k_r; v_r]`` order: the module
    that consumes it splits by the (scaled) per-rank width, which is what we want.
    ``row_layout``: the output rows stored in another order, or some on several ranks
    (``tensor_parallel/row_layout.py``: fused q|k|v of unequal widths, k/v heads fewer than ranks).
    """

    def __init__(
        self,
        *,
        num_chunks: int = 1,
        row_layout: RowLayout | None = None,
        sliced_input_width: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        self.num_chunks = num_chunks
        self.row_layout = row_layout
        # a projection of the heads' values (Doge's ``dt_proj``: one output per head from every head's values):
        # an input this wide is the rank's slice of its features, gathered first; a whole one is replicated
        self.sliced_input_width = sliced_input_width

    @property
    def fused_as_rows(self) -> bool:
        """A fused projection stored as a row layout, because this torch cannot run ``_StridedShard``."""
        return self.num_chunks > 1 and self.row_layout is None and not strided_shard_in_ops()

    def _partition_projection_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        dims = sharded_dims(module, self)
        placements = {name: _split_placement(dim, self.num_chunks) for name, dim in dims.items()}
        if self.row_layout is None and not self.fused_as_rows:
            _distribute_params(module, device_mesh, placements, self.src_data_rank)
            return
        for param_name, dim in dims.items():
            param = getattr(module, param_name, None)
            if param is None:
                continue
            if self.row_layout is None:
                layout = fused_rows(param.shape[dim], self.num_chunks, device_mesh.size()).along(dim)
            else:
                layout = self.row_layout.along(dim)
            stored = distribute_tensor(
                layout.stored(param.detach()), device_mesh, [Shard(dim)], src_data_rank=None
            )
            new = nn.Parameter(stored, requires_grad=param.requires_grad)
            setattr(new, ROW_LAYOUT, layout)
            module.register_parameter(param_name, new)

    @staticmethod
    def _prepare_fused_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> torch.Tensor | DTensor:
        # A strided (fused) output is consumed locally; redistributing it to Shard(-1) would
        # shuffle q/k/v across ranks for nothing.
        if use_local_output:
            return outputs.to_local()
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        if not is_projection(module):
            raise NotImplementedError(
                f"ColwiseProjection supports Linear, Conv1D and Embedding, not {type(module)}"
            )
        output_fn = self._prepare_fused_output_fn if self.num_chunks > 1 else self._prepare_output_fn
        input_fn = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        if self.sliced_input_width is not None:
            input_fn = partial(
                self._prepare_sliced_or_whole_input, self.sliced_input_width, self.desired_input_layouts
            )
        return distribute_module(
            module,
            device_mesh,
            self._partition_projection_fn,
            input_fn,
            partial(output_fn, self.output_layouts, self.use_local_output),
        )

    @staticmethod
    def _prepare_sliced_or_whole_input(
        sliced: int, desired: Any, mod: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh
    ) -> DTensor:
        x = inputs[0]
        if not isinstance(x, DTensor):
            placement = Shard(x.dim() - 1) if x.shape[-1] == sliced else Replicate()
            x = DTensor.from_local(x, device_mesh, [placement], run_check=False)
        return x.redistribute(placements=desired)

    def __repr__(self) -> str:
        fused = f", num_chunks={self.num_chunks}" if self.num_chunks > 1 else ""
        rows = f", rows={self.row_layout.label}" if self.row_layout is not None else ""
        return f"Colwise(out={self.output_layouts[0]}{fused}{rows})"


class RowwiseProjection(RowwiseParallel):
    """Row parallelism for ``nn.Linear`` and ``Conv1D`` (Conv1D's input dim is its weight's dim 0).

    Under sequence parallelism the output is scattered along the sequence, dimension 1 of ``(batch, seq,
    width)``; an MLP that runs on the tokens flattened to ``(tokens, width)`` (a shared expert inside an MoE
    block) has its sequence shards along dimension 0, and gets them back there."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> Any:
        layouts = tuple(output_layouts) if isinstance(output_layouts, (tuple, list)) else (output_layouts,)
        if outputs.dim() == 2 and layouts == (Shard(1),):
            layouts = (Shard(0),)
        return RowwiseParallel._prepare_output_fn(layouts, use_local_output, mod, outputs, device_mesh)

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placements = {name: Shard(dim) for name, dim in sharded_dims(module, self).items()}
        _distribute_params(module, device_mesh, placements, self.src_data_rank)  # the bias stays whole

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return f"Rowwise(in={self.input_layouts[0]}, out={self.output_layouts[0]})"


class TokenEmbedding(RowwiseParallel):
    """The vocabulary-parallel token embedding; what the model receives is a tensor of its own, not a view of the
    DTensor's local one: model code scales the embedding in place (CTRL's ``inputs_embeds *= sqrt(d)``), which
    autograd refuses on the view a custom function returned. One copy of the embedding output per step."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> Any:
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output and not isinstance(out, DTensor) else out
