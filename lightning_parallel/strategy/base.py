"""Lightning's ``ModelParallelStrategy`` behaviour, without being a ``ModelParallelStrategy``.

The bottom of the strategy's three classes: this one (Lightning's members, and the one mesh:
degrees, process group, ``DeviceMesh``, precision plugin), then ``CheckpointingStrategy``
(``strategy/checkpointing.py``: the checkpoint hooks), then ``HybridParallelStrategy``
(``strategy/hybrid.py``: setup and the step hooks). Each declares the state it owns in its
``__init__``; the subclasses read it, typed.

We want its process-group set-up, launcher, collectives and distributed-checkpoint saving
(``torch.distributed.checkpoint``), but Lightning's accelerator connector refuses
``precision="16-mixed"`` for any instance of that class: it assumes FSDP2's own mixed
precision, while this project installs a loss-scaling plugin that works across shards. So
this base derives from ``ParallelStrategy`` and takes Lightning's implementations member by
member: Lightning stays the single source of that code, and the class is not an instance of
``ModelParallelStrategy`` for the connector's check.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_parallel import compat
from lightning_parallel.config import ParallelConfig
from lightning_parallel.config.validation import check_launch, check_zero_precision, resolve_dims
from lightning_parallel.launch.placement import check_tensor_parallel_placement
from lightning_parallel.mesh import Axis, ParallelDims
from lightning_parallel.precision import convert_precision_plugin
from lightning_parallel.zero import ZeroPrecision
from lightning_parallel.zero.engine_choice import Engine, config_engine

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_Lightning = ModelParallelStrategy


class MeshParallelStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` with one ``DeviceMesh``, built from the validated configuration."""

    def __init__(
        self,
        config: ParallelConfig,
        *,
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
        self.config = config
        """What the user asked for, validated (``config/``); never changed after construction."""
        self.dims: ParallelDims | None = None
        """The resolved degrees, from ``Trainer(...)`` on (``tensor_parallel="auto"`` needs the devices)."""
        self.zero_runs_on: Engine | None = None
        """Which engine runs ZeRO in this layout (``zero/engine_choice.py``), resolved with the degrees."""

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()``: parameters are created for real, ``empty_init`` or not (no meta device).

        Lightning's ``ModelParallelStrategy`` creates them on the meta device and leaves the materialising to the
        user's ``configure_model``; this strategy runs the user's step once on the whole model at setup (pipeline
        discovery, plan verification), which meta tensors cannot, and shards what it is given.
        """
        with self.precision_plugin.tensor_init_context():
            yield

    @property
    def is_distributed(self) -> bool:
        """Lightning asks custom strategies this (distributed sampler, logging sync)."""
        return True

    # Lightning's ModelParallelStrategy members, taken as they are (see module docstring): each delegates to
    # Lightning's code, which stays the one source; @override marks those that replace a ParallelStrategy member.

    @property
    @override
    def root_device(self) -> torch.device:
        return _Lightning.root_device.fget(self)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return _Lightning.restore_checkpoint_after_setup.fget(self)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return _Lightning.lightning_restore_optimizer.fget(self)

    @override
    def model_to_device(self) -> None:
        _Lightning.model_to_device(self)

    @override
    def barrier(self, name: str | None = None) -> None:
        _Lightning.barrier(self, name)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return _Lightning.broadcast(self, obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> torch.Tensor:
        return _Lightning.reduce(self, tensor, group, reduce_op)

    @override
    def teardown(self) -> None:
        _Lightning.teardown(self)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _Lightning.lightning_module_state_dict(self)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        _Lightning.load_model_state_dict(self, checkpoint, strict=strict)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _Lightning.optimizer_state(self, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        _Lightning.load_optimizer_state_dict(self, checkpoint)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return _Lightning.load_checkpoint(self, checkpoint_path, weights_only)

    # Lightning's helpers its code above calls on ``self``; they override nothing.
    device_mesh = _Lightning.device_mesh
    num_processes = _Lightning.num_processes
    process_group_backend = _Lightning.process_group_backend
    _determine_device_ids = _Lightning._determine_device_ids
    _get_process_group_backend = _Lightning._get_process_group_backend
    set_world_ranks = _Lightning.set_world_ranks

    # Lightning's versions of these call ``super()`` bound to ModelParallelStrategy; same logic here.

    @override
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
        compat.init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

    # ---- our mesh ------------------------------------------------------------------------

    @property
    def deepspeed_zero(self) -> bool:
        """Whether ZeRO runs on DeepSpeed's engine in this layout (ZeRO-3 with tensor parallelism runs on FSDP2
        and keeps Lightning's precision plugins)."""
        return self.zero_runs_on == "deepspeed"

    @property
    def tensor_parallel(self) -> int:
        if self.dims is None:
            raise RuntimeError("The tensor-parallel degree is resolved when the Trainer is created.")
        return self.dims.tensor_parallel

    def _resolve_layout(self) -> ParallelDims:
        """The degrees and the engine they imply, checked: before the launch or, under torchrun and SLURM, at
        the start of each process."""
        dims = resolve_dims(self.config, type(self).__name__, self.num_processes, self.num_nodes)
        check_launch(self.config, dims, self.precision_plugin)
        self.dims, self.zero_runs_on = dims, config_engine(self.config, dims)
        return dims

    @override
    def _configure_launcher(self) -> None:
        # Runs inside Trainer(...), before processes are launched: fail here, not in a collective.
        self._resolve_layout()
        if not self.deepspeed_zero:
            convert_precision_plugin(self.precision_plugin)  # an unsupported plugin fails here, before launch
        _Lightning._configure_launcher(self)

    @override
    def setup_environment(self) -> None:
        dims = self.dims or self._resolve_layout()  # launched by torchrun or SLURM: no _configure_launcher
        self._setup_distributed()
        self._device_mesh = dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        # Lightning's plugin, same precision, with clipping by the global norm over all shards and
        # an fp16 overflow decision shared by every rank; under ZeRO, DeepSpeed's (scaler, masters, clipping).
        if self.config.zero.enabled:
            check_zero_precision(self.config.zero, self.precision_plugin)
        if self.deepspeed_zero:
            if not isinstance(self.precision_plugin, ZeroPrecision):
                precision = self.precision_plugin.precision
                own_scale = self.config.zero.precision_override(precision) is None
                self.precision_plugin = ZeroPrecision(
                    precision,
                    self.root_device.type,
                    own_loss_scale=own_scale,
                    scaler=getattr(self.precision_plugin, "scaler", None),  # a user's GradScaler settings
                )
        else:
            pp_group = self._device_mesh[Axis.PP].get_group() if self.dims.pp_enabled else None
            self.precision_plugin = convert_precision_plugin(self.precision_plugin, pipeline_group=pp_group)
        rank_zero_info(
            f"{type(self).__name__}: mesh {self.dims.describe()}, ranks from {type(self.cluster_environment).__name__}"
        )
        check_tensor_parallel_placement(self)  # warn if a tensor-parallel group spans nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Context ranks share their batch (each holds other tokens of it): the sampler's replicas are dp_batch.
        dp_mesh = self.device_mesh[
            Axis.DP_BATCH if self.dims is not None and self.dims.cp_enabled else Axis.DP
        ]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}
