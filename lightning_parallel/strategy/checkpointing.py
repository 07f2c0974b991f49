"""Sharded checkpoints that understand fused (strided) tensor-parallel shards.

Lightning's distributed-checkpoint code assumes each rank's shard is one box of the global
tensor. Fused projections (q|k|v) are ``_StridedShard``: each rank holds several pieces, which
``torch.distributed.checkpoint`` rejects as overlapping on save, and which Lightning's
consolidated-file loader would cut wrongly on load. This layer converts at the boundary: the
files always hold the user's own layout, and the model keeps its strided placements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
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


def _expert_layouts(model: torch.nn.Module) -> dict[str, Any]:
    """Parameters that hold a slice of a stacked expert weight (expert parallelism), by name."""
    from lightning_parallel.experts import expert_shard

    out = {}
    for name, param in model.named_parameters():
        shard = expert_shard(param)
        if shard is not None and shard.dim == 0 and shard.ep_size > 1:
            out[name] = shard
    return out


def _owner_name(key: str, optimizer: bool) -> str:
    """The parameter name of a state-dict key (flattened optimizer keys are ``state.<fqn>.<state>``)."""
    if not optimizer:
        return key
    return key[len("state.") :].rpartition(".")[0] if key.startswith("state.") else ""


def _experts_as_dtensors(
    state: dict[str, Any], layouts: dict[str, Any], mesh: Any, optimizer: bool
) -> dict[str, Any]:
    """Expert slices are the same name on every ep rank with different rows: as plain tensors,
    ``torch.distributed.checkpoint`` would keep one rank's rows. As ``Shard(0)`` DTensors over the
    ``ep`` axis the files hold the whole stacked tensor, which also reshards to another ``ep``."""
    if not layouts:
        return state
    out = dict(state)
    for key, value in state.items():
        shard = layouts.get(_owner_name(key, optimizer))
        if shard is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if value.dim() == 0 or value.shape[0] != shard.num_local:
            continue
        global_shape = torch.Size((shard.num_experts, *value.shape[1:]))
        stride = torch.empty(global_shape, device="meta").stride()
        out[key] = DTensor.from_local(
            value, mesh, [Shard(0)], run_check=False, shape=global_shape, stride=stride
        )
    return out


def _experts_as_local(state: dict[str, Any], layouts: dict[str, Any], optimizer: bool) -> dict[str, Any]:
    if not layouts:
        return state
    return {
        k: v.to_local() if isinstance(v, DTensor) and _owner_name(k, optimizer) in layouts else v
        for k, v in state.items()
    }


def consolidated_refusal(pipeline_parallel: int, expert_parallel: int, zero_stage: int) -> str | None:
    """Why one consolidated checkpoint file cannot hold this layout (``None``: it can).

    Asked at construction (before any process exists) and again at each save and load, because
    ``save_distributed_checkpoint`` can be changed on the strategy in between.
    """
    if zero_stage:
        return (
            "`save_distributed_checkpoint=False` (one consolidated file) is not supported with ZeRO: every master"
            " weight would be gathered on rank 0 at each save. Save the sharded checkpoint (the default) and turn it"
            " into one fp32 state dict afterwards with `lightning_parallel.consolidate_checkpoint(path)` or"
            " `python -m lightning_parallel export CHECKPOINT OUT.safetensors`."
        )
    if pipeline_parallel > 1 or expert_parallel > 1:
        return (
            "`save_distributed_checkpoint=False` (one consolidated file) is not supported with"
            f" `pipeline_parallel={pipeline_parallel}` / `expert_parallel={expert_parallel}` yet: each rank holds"
            " different weights under the same names, and the file would keep rank 0's only. Leave it True"
            " (sharded checkpoints hold every weight) and export a checkpoint folder as one file with"
            " `python -m lightning_parallel export CKPT model.safetensors` (docs/checkpoints.md)."
        )
    return None


# The strategy's own part of a checkpoint's metadata (Lightning writes rank 0's dict only, so
# per-rank values are gathered into lists indexed by global rank).
STATE_KEY = "lightning_parallel"


def _fit_progress(trainer: Any) -> tuple[int, int]:
    """(epoch, batches trained in it) as the fit loop counts them (after its restart adjustments)."""
    loop = trainer.fit_loop
    return loop.epoch_progress.current.processed, loop.epoch_loop.batch_progress.current.ready


class ShardedCheckpointing(MeshParallelStrategy):
    """``MeshParallelStrategy`` whose checkpoints keep fused projections in the user's layout, are written
    atomically, hold every rank's random state, and resume a plain training ``DataLoader`` mid-epoch."""

    init_weights: Path | None

    def _load_init_weights(self, module: torch.nn.Module) -> None:
        """``init_weights``: after sharding, before the optimizer exists (``checkpoint/transfer.py``)."""
        if self.init_weights is None:
            return
        from lightning_parallel.checkpoint.transfer import load_weights

        load_weights(module, self.init_weights, strict=getattr(module, "strict_loading", True))
        rank_zero_info(f"{type(self).__name__}: loaded the weights of {self.init_weights}")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders become stateful (``checkpoint/dataloader.py``), so Lightning stores their
        position and a mid-epoch checkpoint continues with the very next batch."""
        from lightning_parallel.checkpoint.dataloader import make_resumable

        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return make_resumable(dataloader, functools.partial(_fit_progress, trainer))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Sharded (one folder, ``torch.distributed.checkpoint``) or consolidated (one file), written to a
        hidden folder beside it and moved into place only when complete (``checkpoint/atomic.py``)."""
        from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from lightning.fabric.utilities.seed import _collect_rng_states

        from lightning_parallel.checkpoint import atomic
        from lightning_parallel.checkpoint.dataloader import _gather
        from lightning_parallel.checkpoint.random_states import portable_rng_states

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported."
            )
        if not self._save_distributed_checkpoint:
            self._check_consolidated_supported()  # on every rank, before any collective
        path = Path(self.broadcast(str(filepath)))
        dims = getattr(self, "dims", None)
        checkpoint[STATE_KEY] = {
            "rng_states": _gather(portable_rng_states(_collect_rng_states())),
            "layout": dict(dims.degrees) if dims is not None else None,
        }
        staging = atomic.staging_path(path)
        if self.global_rank == 0:
            staging.parent.mkdir(parents=True, exist_ok=True)
            atomic.remove(staging)  # what an earlier, interrupted save left
        self.barrier("lightning_parallel.save_checkpoint.begin")
        if self._save_distributed_checkpoint:
            staging.mkdir(parents=True, exist_ok=True)
            converted = {"state_dict": checkpoint.pop("state_dict")}
            converted.update(
                {f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))}
            )
            _distributed_checkpoint_save(converted, staging)  # returns once every rank's shard is written
            if self.global_rank == 0:
                torch.save(checkpoint, staging / _METADATA_FILENAME)  # last: marks the folder complete
        elif self.global_rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, staging)
        self.barrier("lightning_parallel.save_checkpoint.written")
        if self.global_rank == 0:
            atomic.commit(staging, path)
        self.barrier("lightning_parallel.save_checkpoint.committed")

    def _restore_random_states(self, checkpoint: dict[str, Any]) -> None:
        """Each rank's random state as it was at the save (dropout, random samplers): the exact-resume part
        Lightning does not store. With another number of ranks, rank 0's state (ranks seeded alike)."""
        from lightning.fabric.utilities.seed import _set_rng_states

        from lightning_parallel.checkpoint.random_states import native_rng_states

        states = (checkpoint.get(STATE_KEY) or {}).get("rng_states")
        if not states:
            return
        _set_rng_states(
            native_rng_states(states[self.global_rank] if len(states) == self.world_size else states[0])
        )

    def _check_consolidated_supported(self, zero_only: bool = False) -> None:
        """``zero_only``: loading a consolidated file is refused under ZeRO only (under pp/ep it loads)."""
        dims = getattr(self, "dims", None)
        zero = getattr(self, "zero", None)
        reason = consolidated_refusal(
            dims.pipeline_parallel if dims is not None and not zero_only else 1,
            dims.expert_parallel if dims is not None and not zero_only else 1,
            zero.stage if zero is not None else 0,
        )
        if reason is not None:
            raise ValueError(reason)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            self._check_consolidated_supported()
            return super().lightning_module_state_dict()
        if getattr(self, "zero_enabled", False):  # DeepSpeed's fp32 masters, same layout (zero/checkpoint.py)
            from lightning_parallel.zero.checkpoint import zero_model_state

            return zero_model_state(self.lightning_module, self._ep_mesh())
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        layouts = _expert_layouts(self.model)
        state = _experts_as_dtensors(
            get_model_state_dict(self.model), layouts, self._ep_mesh(), optimizer=False
        )
        return _contiguous_shards(state)

    def _ep_mesh(self) -> Any:
        dims = getattr(self, "dims", None)
        return self.device_mesh["ep"] if dims is not None and dims.ep_enabled else None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if getattr(self, "zero_enabled", False):
            from lightning_parallel.zero.checkpoint import zero_optimizer_state

            return zero_optimizer_state(self.lightning_module, optimizer, self.zero_engine, self._ep_mesh())
        assert self.model is not None
        state = get_optimizer_state_dict(self.model, optimizer, options=_FLAT)
        layouts = _expert_layouts(self.model)
        return _contiguous_shards(_experts_as_dtensors(state, layouts, self._ep_mesh(), optimizer=True))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.fabric.strategies.model_parallel import _is_full_checkpoint, _is_sharded_checkpoint

        from lightning_parallel.checkpoint import atomic

        path = Path(self.broadcast(str(checkpoint_path)))
        if self.global_rank == 0:
            atomic.recover(path, log=rank_zero_info)  # a crash in the middle of moving a save into place
        self.barrier("lightning_parallel.load_checkpoint.recover")
        if _is_sharded_checkpoint(path):
            checkpoint = self._load_sharded_checkpoint(path, weights_only)
        elif _is_full_checkpoint(path):
            checkpoint = self._load_full_checkpoint(path, weights_only)
        else:
            # Lightning's error for a bad path
            return super().load_checkpoint(path, weights_only=weights_only)
        self._restore_random_states(checkpoint)
        return checkpoint

    def _load_sharded_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """As :meth:`_read_sharded_checkpoint`; a damaged folder is reported as such, never half-loaded."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        try:
            return self._read_sharded_checkpoint(path, weights_only)
        except (Exception, CheckpointException) as error:  # any read failure means the same to the user
            raise ValueError(
                f"The checkpoint {str(path)!r} is damaged or incomplete (a shard file is truncated, missing or"
                f" unreadable), so it was not loaded: {type(error).__name__}: {error}. Resume from an earlier"
                " checkpoint."
            ) from error

    def _read_sharded_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """As Lightning's loader, but fused projections are read as Shard(dim) (see _contiguous_shards)."""
        from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        if getattr(self, "zero_enabled", False):
            from lightning_parallel.zero.checkpoint import load_zero_checkpoint

            optimizer = self.optimizers[0] if self.zero_engine is not None else None  # none: validate/test
            load_zero_checkpoint(self.lightning_module, optimizer, self.zero_engine, path, self._ep_mesh(),
                                 strict=self.lightning_module.strict_loading)  # fmt: skip
            return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        layouts, ep_mesh = _expert_layouts(self.model), self._ep_mesh()
        model_state = _experts_as_dtensors(
            get_model_state_dict(self.model), layouts, ep_mesh, optimizer=False
        )
        readable = _contiguous_shards(model_state)
        _distributed_checkpoint_load({"state_dict": readable}, path)
        self.model.load_state_dict(
            _experts_as_local(_restore_strided(readable, model_state), layouts, optimizer=False),
            strict=self.lightning_module.strict_loading,
        )
        for idx, optimizer in enumerate(self.optimizers):
            optimizer_state = get_optimizer_state_dict(self.model, optimizer, options=_FLAT)
            optimizer_state = _experts_as_dtensors(optimizer_state, layouts, ep_mesh, optimizer=True)
            readable = _contiguous_shards(optimizer_state)
            _distributed_checkpoint_load({f"optimizer_{idx}": readable}, path)
            restored = _experts_as_local(_restore_strided(readable, optimizer_state), layouts, optimizer=True)
            set_optimizer_state_dict(self.model, optimizer, restored, options=_FLAT)
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
        self._check_consolidated_supported(zero_only=True)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for idx, optimizer in enumerate(self.optimizers):
            optimizer_state = _rekey_optimizer_state_if_needed(
                checkpoint["optimizer_states"][idx], self.model
            )
            set_optimizer_state_dict(self.model, optimizer, optimizer_state, options=options)
        return checkpoint
