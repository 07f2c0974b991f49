"""The strategy's checkpoint hooks: sharded or consolidated, atomic, exact resume, in the user's layout.

Lightning's hooks (``save_checkpoint``, ``lightning_module_state_dict``, ``optimizer_state``,
``load_checkpoint``, ``process_dataloader``) on top of the conversions in ``checkpoint/``: fused
projections and expert slices are written in the user's layout (``checkpoint/layouts.py``),
ZeRO's fp32 masters as the same entries (``checkpoint/zero.py``), every save is moved into place
only when complete (``checkpoint/atomic.py``), and every rank's random state and a plain
training ``DataLoader``'s position are stored for an exact resume.

:class:`CheckpointingStrategy` also declares the state the strategy's setup fills (the
parallelized module's record, DeepSpeed's engine), so that these hooks and
``HybridParallelStrategy`` read the same typed attributes.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import compat
from lightning_parallel.checkpoint import atomic
from lightning_parallel.checkpoint.dataloader import gather_objects, make_resumable
from lightning_parallel.checkpoint.layouts import (
    FLAT,
    contiguous_shards,
    expert_layouts,
    experts_as_dtensors,
    experts_as_local,
    hyper_parameters_to_read,
    rename_parameters,
    restore_strided,
    saved_keys,
)
from lightning_parallel.checkpoint.loop_state import loader_states, reopen_cut_epoch
from lightning_parallel.checkpoint.random_states import native_rng_states, portable_rng_states
from lightning_parallel.checkpoint.row_layouts import (
    full_optimizer_rows_as_stored,
    full_optimizer_rows_as_user,
    full_rows_as_stored,
    full_rows_as_user,
    registry,
    rows_as_stored,
    rows_as_user,
)
from lightning_parallel.checkpoint.safe_load import (
    UnsafeCheckpointError,
    load_trusted_or_weights,
    size_mismatch,
)
from lightning_parallel.checkpoint.transfer import load_weights
from lightning_parallel.checkpoint.zero import load_zero_checkpoint, zero_model_state, zero_optimizer_state
from lightning_parallel.config import ParallelConfig
from lightning_parallel.config.validation import consolidated_refusal
from lightning_parallel.mesh import Axis
from lightning_parallel.parallelize import Parallelized
from lightning_parallel.strategy.base import MeshParallelStrategy
from lightning_parallel.zero.engine import release_engine

# The strategy's own part of a checkpoint's metadata (Lightning writes rank 0's dict only, so
# per-rank values are gathered into lists indexed by global rank).
STATE_KEY = "lightning_parallel"
RESUME = "`Trainer.fit(ckpt_path=...)`"  # names the call in a refusal to unpickle


def _fit_progress(trainer: Any) -> tuple[int, int]:
    """(epoch, batches trained in it) as the fit loop counts them (after its restart adjustments)."""
    loop = trainer.fit_loop
    return loop.epoch_progress.current.processed, loop.epoch_loop.batch_progress.current.ready


class CheckpointingStrategy(MeshParallelStrategy):
    """``MeshParallelStrategy`` whose checkpoints keep fused projections in the user's layout, are written
    atomically, hold every rank's random state, and resume a plain training ``DataLoader`` mid-epoch."""

    def __init__(
        self,
        config: ParallelConfig,
        *,
        save_distributed_checkpoint: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
    ) -> None:
        super().__init__(
            config,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.parallelized: Parallelized | None = None
        """What ``setup`` did to the module (``parallelize/``); None before setup. It stays after teardown
        (``strategy.plan`` is read after ``fit``), as the hooks stay on the module, which a later
        fit/validate/test/predict reuses as it is."""
        self.zero_engine: Any = None
        self.last_loader_states: list[Any] | None = None  # the training loaders' states at the last batch

    def remember_loader_states(self) -> None:
        """Called on each training batch: what a save after ``fit`` must restore (``checkpoint/loop_state.py``)."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        self.last_loader_states = loader_states(trainer) if trainer is not None else None
        """DeepSpeed's engine under ZeRO while fitting, else None."""

    def _load_init_weights(self, module: torch.nn.Module, path: Path) -> None:
        """``init_weights``: after sharding, before the optimizer exists (``checkpoint/transfer.py``)."""
        load_weights(module, path, strict=getattr(module, "strict_loading", True))
        rank_zero_info(f"{type(self).__name__}: loaded the weights of {path}")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders become stateful (``checkpoint/dataloader.py``), so Lightning stores their
        position and a mid-epoch checkpoint continues with the very next batch."""
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

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported."
            )
        if not self._save_distributed_checkpoint:
            self._check_consolidated_supported()  # on every rank, before any collective
        path = Path(self.broadcast(str(filepath)))
        # saved after max_steps cut an epoch short: resume inside it
        reopen_cut_epoch(checkpoint, self.last_loader_states)
        checkpoint[STATE_KEY] = {
            "rng_states": gather_objects(portable_rng_states(compat.collect_rng_states())),
            "layout": self.dims.layout if self.dims is not None else None,
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
            # returns once every rank's shard is written
            compat.distributed_checkpoint_save(converted, staging)
            if self.global_rank == 0:
                torch.save(checkpoint, staging / compat.METADATA_FILENAME)  # last: marks the folder complete
        elif self.global_rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, staging)
        self.barrier("lightning_parallel.save_checkpoint.written")
        if self.global_rank == 0:
            atomic.commit(staging, path)
        self.barrier("lightning_parallel.save_checkpoint.committed")

    def _restore_random_states(self, checkpoint: dict[str, Any]) -> None:
        """Each rank's random state as it was at the save (dropout, random samplers): the exact-resume part
        Lightning does not store. With another number of ranks, rank 0's state (ranks seeded alike)."""

        states = (checkpoint.get(STATE_KEY) or {}).get("rng_states")
        if not states:
            return
        compat.set_rng_states(
            native_rng_states(states[self.global_rank] if len(states) == self.world_size else states[0])
        )

    def _check_consolidated_supported(self, *, zero_only: bool = False) -> None:
        """``zero_only``: loading a consolidated file is refused under ZeRO only (under pp/ep it loads)."""
        dims = self.dims
        reason = consolidated_refusal(
            dims.pipeline_parallel if dims is not None and not zero_only else 1,
            dims.expert_parallel if dims is not None and not zero_only else 1,
            self.config.zero.stage,
        )
        if reason is not None:
            raise ValueError(reason)

    def settle_deferred_updates(self, *, close: bool = False) -> None:
        """Install any update still in flight or pending (``offload_update``: ``zero/delayed_update.py``,
        ``zero/importance_split.py``) before the parameters are read whole (a checkpoint, the end of ``fit``);
        ``close`` also stops its worker. ZeRO-2 on FSDP2 then gathers the installed shards again (its whole
        parameters are what the model holds)."""
        deferred = [vars(getattr(o, "_optimizer", o)).get("deferred_update") for o in self.optimizers]
        installed = [(d.close() if close else d.settle()) for d in deferred if d is not None]
        if any(installed) and self.parallelized is not None:
            self.parallelized.gradients.gather_again()

    @override
    def teardown(self) -> None:
        self.settle_deferred_updates(close=True)  # the end of fit: the model holds the last update
        if self.zero_engine is not None:  # else DeepSpeed keeps it, the module and the Trainer for ever
            release_engine(self.zero_engine)
        super().teardown()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.settle_deferred_updates()  # a checkpoint holds the latest parameters with their states
        if not self._save_distributed_checkpoint:
            self._check_consolidated_supported()
            return full_rows_as_user(super().lightning_module_state_dict(), registry(self.model))
        if self.deepspeed_zero:  # DeepSpeed's fp32 masters, same layout (checkpoint/zero.py)
            return zero_model_state(self.lightning_module, self._ep_mesh())

        assert self.model is not None
        layouts = expert_layouts(self.model)
        state = rows_as_user(get_model_state_dict(self.model), registry(self.model), optimizer=False)
        state = experts_as_dtensors(
            state, layouts, self._ep_mesh(), optimizer=False, replicas_mesh=self._expert_replicas_mesh()
        )
        return contiguous_shards(state)

    def _ep_mesh(self) -> Any:
        return self.device_mesh[Axis.EP] if self.dims is not None and self.dims.ep_enabled else None

    def _expert_replicas_mesh(self) -> Any:
        """``(dp_replicate, ep)``: where ZeRO's FSDP2 shards of expert slices live (checkpoint/layouts.py)."""
        if self.dims is None or not self.dims.ep_enabled:
            return None
        return self.device_mesh[Axis.DP_REPLICATE, Axis.EP]

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self.settle_deferred_updates()
        if not self._save_distributed_checkpoint:
            return self._consolidated_optimizer_state(optimizer)

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if self.deepspeed_zero:
            return zero_optimizer_state(self.lightning_module, optimizer, self.zero_engine, self._ep_mesh())
        assert self.model is not None
        state = rows_as_user(
            get_optimizer_state_dict(self.model, optimizer, options=FLAT),
            registry(self.model),
            optimizer=True,
        )
        layouts = expert_layouts(self.model)
        state = experts_as_dtensors(
            state, layouts, self._ep_mesh(), optimizer=True, replicas_mesh=self._expert_replicas_mesh()
        )
        return contiguous_shards(rename_parameters(state, self._weights_named_apart()))

    def _weights_named_apart(self) -> dict[str, str]:
        """A pipeline stage's names for the weights it knows by another name than one process (a module its
        blocks share with another stage's) -> the one-process names, which the files hold."""
        runner = self.parallelized.pipeline if self.parallelized else None
        return runner.weights_named_apart if runner is not None else {}

    def _consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Lightning's consolidated optimizer state (keyed by parameter index on rank 0), with the tensors of
        weights stored in a row layout put back in the user's rows first (by name, before the re-keying)."""
        rows = registry(self.model)
        if not rows:
            return super().optimizer_state(optimizer)

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = full_optimizer_rows_as_user(
            get_optimizer_state_dict(self.model, optimizer, options=options), rows
        )
        if self.global_rank == 0:
            state = compat.align_compiled_param_names_with_module(state, self.model)
            state = FullyShardedDataParallel.rekey_optim_state_dict(
                state, OptimStateKeyType.PARAM_ID, self.model
            )
        return state

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.global_rank == 0:
            atomic.recover(path, log=rank_zero_info)  # a crash in the middle of moving a save into place
        self.barrier("lightning_parallel.load_checkpoint.recover")
        if compat.is_sharded_checkpoint(path):
            checkpoint = self._load_sharded_checkpoint(path, weights_only)
        elif compat.is_full_checkpoint(path):
            checkpoint = self._load_full_checkpoint(path, weights_only)
        else:
            # Lightning's error for a bad path
            return super().load_checkpoint(path, weights_only=weights_only)
        self._restore_random_states(checkpoint)
        return checkpoint

    def _load_sharded_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """As :meth:`_read_sharded_checkpoint`; a damaged folder is reported as such, never half-loaded."""

        try:
            return self._read_sharded_checkpoint(path, weights_only)
        except UnsafeCheckpointError:
            raise  # intact, but refused: not "damaged"
        except (Exception, CheckpointException) as error:  # any read failure means the same to the user
            mismatch = size_mismatch(error)
            if mismatch:  # intact, but written for another model (or another configuration of it)
                raise ValueError(
                    f"The checkpoint {str(path)!r} does not fit this module: {mismatch}. It was saved from a model"
                    " of other sizes (or another configuration of it): resume with the model it was saved from."
                ) from error
            raise ValueError(
                f"The checkpoint {str(path)!r} is damaged or incomplete (a shard file is truncated, missing or"
                f" unreadable), so it was not loaded: {type(error).__name__}: {error}. Resume from an earlier"
                " checkpoint."
            ) from error

    def _read_sharded_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """As Lightning's loader, but fused projections are read as Shard(dim) (see contiguous_shards)."""

        assert self.model is not None and self.lightning_module is not None
        if self.deepspeed_zero:
            optimizer = self.optimizers[0] if self.zero_engine is not None else None  # none: validate/test
            load_zero_checkpoint(
                self.lightning_module,
                optimizer,
                self.zero_engine,
                path,
                self._ep_mesh(),
                strict=self.lightning_module.strict_loading,
            )
            return load_trusted_or_weights(path / compat.METADATA_FILENAME, RESUME, weights_only)
        layouts, ep_mesh, replicas = expert_layouts(self.model), self._ep_mesh(), self._expert_replicas_mesh()
        rows = registry(self.model)
        stored = get_model_state_dict(self.model)
        original = rows_as_user(stored, rows, optimizer=False)
        model_state = experts_as_dtensors(original, layouts, ep_mesh, optimizer=False, replicas_mesh=replicas)
        readable = contiguous_shards(model_state)
        compat.distributed_checkpoint_load({"state_dict": readable}, path)
        loaded = experts_as_local(
            restore_strided(readable, model_state), layouts, optimizer=False, like=original
        )
        self.model.load_state_dict(
            rows_as_stored(loaded, stored, rows, optimizer=False), strict=self.lightning_module.strict_loading
        )
        for idx, optimizer in enumerate(self.optimizers):
            stored = get_optimizer_state_dict(self.model, optimizer, options=FLAT)
            original = rows_as_user(stored, rows, optimizer=True)
            optimizer_state = experts_as_dtensors(
                original, layouts, ep_mesh, optimizer=True, replicas_mesh=replicas
            )
            shards = contiguous_shards(optimizer_state)
            apart = self._weights_named_apart()
            readable = hyper_parameters_to_read(
                rename_parameters(shards, apart), saved_keys(path, f"optimizer_{idx}")
            )
            compat.distributed_checkpoint_load({f"optimizer_{idx}": readable}, path)
            readable = rename_parameters(readable, {v: k for k, v in apart.items()})
            restored = experts_as_local(
                restore_strided({**shards, **readable}, optimizer_state),
                layouts,
                optimizer=True,
                like=original,
            )
            restored = rows_as_stored(restored, stored, rows, optimizer=True)
            set_optimizer_state_dict(self.model, optimizer, restored, options=FLAT)
        return load_trusted_or_weights(path / compat.METADATA_FILENAME, RESUME, weights_only)

    def _load_full_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """One consolidated file. Lightning's loader cuts each rank's shard out of the full tensor as one
        box (torch's ``broadcast_from_rank0`` path), which silently loads the wrong rows of a fused
        projection; ``distribute_tensor`` (``broadcast_from_rank0=False``) is right for every placement."""

        assert self.model is not None and self.lightning_module is not None
        self._check_consolidated_supported(zero_only=True)
        checkpoint = load_trusted_or_weights(path, RESUME, weights_only, mmap=True, map_location="cpu")
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        rows = registry(self.model)  # the user's rows of a weight stored in a row layout, in its stored order
        set_model_state_dict(
            self.model, full_rows_as_stored(checkpoint.pop("state_dict"), rows), options=options
        )
        for idx, optimizer in enumerate(self.optimizers):
            optimizer_state = full_optimizer_rows_as_stored(
                compat.rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][idx], self.model), rows
            )
            set_optimizer_state_dict(self.model, optimizer, optimizer_state, options=options)
        return checkpoint
