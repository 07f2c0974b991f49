"""Lightning's ``ModelParallelStrategy`` behaviour, without being a ``ModelParallelStrategy``.

We want its process-group set-up, launcher, collectives and distributed-checkpoint saving
(``torch.distributed.checkpoint``), but Lightning's accelerator connector refuses
``precision="16-mixed"`` for any instance of that class: it assumes FSDP2's own mixed
precision, while this project installs a loss-scaling plugin that works across shards. So
this base derives from ``ParallelStrategy`` and takes Lightning's implementations member by
member: Lightning stays the single source of that code, and the class is not an instance of
``ModelParallelStrategy`` for the connector's check.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save, _is_sharded_checkpoint
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_Lightning = ModelParallelStrategy


class MeshParallelStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` with one ``DeviceMesh`` and sharded (DCP) checkpoints."""

    def __init__(
        self,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__()
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: DeviceMesh | None = None
        self.num_nodes = 1

    @property
    def is_distributed(self) -> bool:
        """Lightning asks custom strategies this (distributed sampler, logging sync)."""
        return True

    # Members taken as they are from Lightning's ModelParallelStrategy (see module docstring).
    device_mesh = _Lightning.device_mesh
    root_device = _Lightning.root_device
    num_processes = _Lightning.num_processes
    process_group_backend = _Lightning.process_group_backend
    restore_checkpoint_after_setup = _Lightning.restore_checkpoint_after_setup
    lightning_restore_optimizer = _Lightning.lightning_restore_optimizer
    _configure_launcher = _Lightning._configure_launcher
    model_to_device = _Lightning.model_to_device
    tensor_init_context = _Lightning.tensor_init_context
    barrier = _Lightning.barrier
    broadcast = _Lightning.broadcast
    reduce = _Lightning.reduce
    _determine_device_ids = _Lightning._determine_device_ids
    teardown = _Lightning.teardown
    lightning_module_state_dict = _Lightning.lightning_module_state_dict
    load_model_state_dict = _Lightning.load_model_state_dict
    optimizer_state = _Lightning.optimizer_state
    load_optimizer_state_dict = _Lightning.load_optimizer_state_dict
    load_checkpoint = _Lightning.load_checkpoint
    _get_process_group_backend = _Lightning._get_process_group_backend
    set_world_ranks = _Lightning.set_world_ranks

    # Lightning's versions of these call ``super()`` bound to ModelParallelStrategy; same logic here.

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Optimizers from an earlier fit refer to parameters that sharding replaced.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    def _setup_distributed(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported."
            )
        path = Path(self.broadcast(filepath))
        if path.is_dir() and not self._save_distributed_checkpoint and not _is_sharded_checkpoint(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        if not self._save_distributed_checkpoint:
            if _is_sharded_checkpoint(path):
                import shutil

                shutil.rmtree(path)
            super().save_checkpoint(checkpoint=checkpoint, filepath=path)
            return
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update(
            {f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))}
        )
        _distributed_checkpoint_save(converted, path)
        if self.global_rank == 0:
            import torch

            torch.save(checkpoint, path / _METADATA_FILENAME)
