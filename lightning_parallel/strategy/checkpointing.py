"""Sharded checkpoints that understand fused (strided) tensor-parallel shards.

Lightning's distributed-checkpoint code assumes each rank's shard is one box of the global
tensor. Fused projections (q|k|v) are ``_StridedShard``: each rank holds several pieces, which
``torch.distributed.checkpoint`` rejects as overlapping on save, and which Lightning's
consolidated-file loader would cut wrongly on load. This layer converts at the boundary: the
files always hold the user's own layout, and the model keeps its strided placements.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.strategy.base import MeshParallelStrategy

# Optimizer state keyed per parameter name ("param_groups.<fqn>.lr", "state.<fqn>.exp_avg"), not
# as one list of parameter groups: under pipeline parallelism each rank holds different
# parameters, and a shared list would be saved by one rank only and loaded wrongly by the rest.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _map_tensors(state: Any, fn: Callable[[Any, Any], Any], like: Any = None) -> Any:
    """Apply ``fn(value, like_value)`` to every tensor of a nested state dict (dicts and lists)."""
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn, like[k] if like is not None else None) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(
            _map_tensors(v, fn, like[i] if like is not None else None) for i, v in enumerate(state)
        )
    return fn(state, like) if isinstance(state, torch.Tensor) else state


def _is_strided(value: Any) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def _contiguous_shards(state: Any) -> Any:
    """Fused projections (q|k|v) are ``_StridedShard``: each rank's shard is several pieces of the
    global tensor, which ``torch.distributed.checkpoint`` cannot describe (it saves one box per
    rank and rejects them as overlapping). Checkpoints hold them as plain ``Shard(dim)``: the
    same global tensor, so the files keep the user's layout."""

    def contiguous(value: Any, _: Any) -> Any:
        if not _is_strided(value):
            return value
        placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]
        return value.redistribute(value.device_mesh, placements)

    return _map_tensors(state, contiguous)


def _restore_strided(loaded: Any, like: Any) -> Any:
    """Inverse of :func:`_contiguous_shards`: back to the placements of ``like``."""

    def restore(value: Any, original: Any) -> Any:
        return (
            value.redistribute(original.device_mesh, original.placements) if _is_strided(original) else value
        )

    return _map_tensors(loaded, restore, like)


class ShardedCheckpointing(MeshParallelStrategy):
    """``MeshParallelStrategy`` whose checkpoints keep fused projections in the user's layout."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return _contiguous_shards(get_model_state_dict(self.model))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return _contiguous_shards(get_optimizer_state_dict(self.model, optimizer, options=_FLAT))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.fabric.strategies.model_parallel import _is_full_checkpoint, _is_sharded_checkpoint

        path = Path(self.broadcast(checkpoint_path))
        if _is_sharded_checkpoint(path):
            return self._load_sharded_checkpoint(path, weights_only)
        if _is_full_checkpoint(path):
            return self._load_full_checkpoint(path, weights_only)
        return super().load_checkpoint(path, weights_only=weights_only)  # Lightning's error for a bad path

    def _load_sharded_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """As Lightning's loader, but fused projections are read as Shard(dim) (see _contiguous_shards)."""
        from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        model_state = get_model_state_dict(self.model)
        readable = _contiguous_shards(model_state)
        _distributed_checkpoint_load({"state_dict": readable}, path)
        self.model.load_state_dict(
            _restore_strided(readable, model_state), strict=self.lightning_module.strict_loading
        )
        for idx, optimizer in enumerate(self.optimizers):
            optimizer_state = get_optimizer_state_dict(self.model, optimizer, options=_FLAT)
            readable = _contiguous_shards(optimizer_state)
            _distributed_checkpoint_load({f"optimizer_{idx}": readable}, path)
            set_optimizer_state_dict(
                self.model, optimizer, _restore_strided(readable, optimizer_state), options=_FLAT
            )
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _load_full_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """One consolidated file. Lightning's loader cuts each rank's shard out of the full tensor as one
        box (torch's ``broadcast_from_rank0`` path), which silently loads the wrong rows of a fused
        projection; ``distribute_tensor`` (``broadcast_from_rank0=False``) is right for every placement."""
        from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for idx, optimizer in enumerate(self.optimizers):
            optimizer_state = _rekey_optimizer_state_if_needed(
                checkpoint["optimizer_states"][idx], self.model
            )
            set_optimizer_state_dict(self.model, optimizer, optimizer_state, options=options)
        return checkpoint
