"""ZeRO inside ``HybridParallelStrategy``: DeepSpeed's engine over the mesh's data-parallel ranks.

The strategy still shards tensors, cuts stages and places experts; DeepSpeed then takes the
result as it is (``deepspeed.initialize`` with the mesh as ``mpu``) and owns what ZeRO is about:
partitioned optimizer states, gradients and parameters, their offloading, the fp32 master
weights, the loss scale and clipping. Lightning keeps the loop: ``configure_optimizers``, LR
schedulers, accumulation, ``gradient_clip_val`` and the precision flag are translated, not
replaced (see ``lightning_parallel/zero/arguments.py``).

What composes, and why the rest is refused (docs/compatibility.md has the tested matrix):

- data parallel: stages 1, 2, 3, with CPU offload (stages 1-3) and NVMe (stage 3).
- tensor parallel: stages 1 and 2. DeepSpeed flattens plain tensors, so each sharded weight is
  handed to it as its local shard (a parametrization rebuilds the DTensor in forward);
  stage 3 would also partition those shards inside DeepSpeed's hooks, which do not know
  DTensors.
- pipeline parallel: stage 1. The schedule runs backward per micro-batch outside the engine;
  stage 1 reduces once in ``step``, stages 2/3 reduce or gather in per-backward/forward hooks
  (DeepSpeed's own pipeline engine refuses them for the same reason).
- expert parallel: stage 1. ZeRO shards over the expert-data-parallel ranks (``dp_replicate``)
  and the experts count as model-parallel slices; the dense gradients are first averaged over
  ``ep`` (one bucketed all-reduce before the step), which stage 1's single reduction allows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.grad_sync import GradientGroup
from lightning_parallel.zero import MeshParallelUnit, ZeroArguments, ZeroPrecision, offload_optimizer
from lightning_parallel.zero.tensor_parallel import local_shard_parameters, mark_model_parallel

NEAREST = "Nearest supported layouts: zero_stage=1 with {other}, or zero_stage={stage} without {name}."


def check_zero_layout(
    zero: ZeroArguments,
    tensor_parallel: int | str,
    pipeline_parallel: int,
    expert_parallel: int,
    activation_checkpointing: str | None = None,
) -> None:
    """Refuse, at construction, the combinations ZeRO cannot run correctly (reasons in the module doc)."""
    if not zero.enabled:
        return
    if activation_checkpointing == "selective":
        raise ValueError(
            f"`activation_checkpointing='selective'` with `zero_stage={zero.stage}` is not supported: under"
            " DeepSpeed's engine the selectively recomputed steps did not reproduce the one-process gradients"
            " (losses 2e-5 to 5e-5 apart after two steps at stages 1 and 3, where full checkpointing and plain data"
            " parallelism agree to 1e-7), and a silently different gradient is worse than an error. Use"
            " `activation_checkpointing='full'` with ZeRO, or selective checkpointing with `zero_stage=0`."
        )
    if pipeline_parallel > 1 and zero.stage > 1:
        raise ValueError(
            f"`zero_stage={zero.stage}` with `pipeline_parallel={pipeline_parallel}` is not supported: the"
            " pipeline schedule runs backward per micro-batch outside DeepSpeed's engine, and ZeRO-2/3 reduce or"
            " gather inside per-backward/forward hooks (DeepSpeed's own pipeline engine refuses them too). "
            + NEAREST.format(other="pipeline_parallel", stage=zero.stage, name="pipeline parallelism")
        )
    if expert_parallel > 1 and zero.stage > 1:
        raise ValueError(
            f"`zero_stage={zero.stage}` with `expert_parallel={expert_parallel}` is not supported: the dense"
            " gradients are averaged over the expert ranks before ZeRO reduces them over the expert-data-parallel"
            " ranks, which needs ZeRO-1's single reduction at the step. "
            + NEAREST.format(other="expert_parallel", stage=zero.stage, name="expert parallelism")
        )
    if tensor_parallel != 1 and zero.stage == 3:
        raise ValueError(
            f"`zero_stage=3` with `tensor_parallel={tensor_parallel}` is not supported: ZeRO-3 partitions and"
            " re-gathers parameters in DeepSpeed's module hooks, which do not know tensor-parallel (DTensor)"
            " shards. Nearest supported layouts: zero_stage=2 (or 1) with tensor_parallel, or zero_stage=3 with"
            " data parallelism only."
        )


def _deepspeed_environment(strategy: Any) -> None:
    """DeepSpeed reads the ranks from the environment (else it tries MPI); Lightning's launchers may not set them."""
    env = strategy.cluster_environment
    values = {
        "RANK": strategy.global_rank,
        "WORLD_SIZE": strategy.world_size,
        "LOCAL_RANK": strategy.local_rank,
        "MASTER_ADDR": env.main_address,
        "MASTER_PORT": env.main_port,
    }
    for key, value in values.items():
        os.environ.setdefault(key, str(value))


class ZeroStrategyMixin:
    """The ZeRO half of ``HybridParallelStrategy`` (arguments: ``zero_stage``, ``offload``, ...)."""

    zero: ZeroArguments
    zero_engine: Any = None

    @property
    def zero_enabled(self) -> bool:
        return self.zero.enabled

    def _zero_precision_plugin(self) -> ZeroPrecision:
        """DeepSpeed's precision for the Trainer's flag; a plugin doing more than a flag is refused.

        Anything beyond Lightning's plain plugins (fp8, quantisation, a custom scaler) would be
        silently dropped: DeepSpeed owns the casts, the master weights and the loss scale here.
        """
        from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

        plugin = self.precision_plugin  # type: ignore[attr-defined]
        if isinstance(plugin, ZeroPrecision):
            return plugin
        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
            raise ValueError(
                f"HybridParallelStrategy(zero_stage={self.zero.stage}): the precision plugin"
                f" {type(plugin).__name__} cannot be used with ZeRO, DeepSpeed owns the precision (casts, fp32"
                " master weights, loss scale). Use `Trainer(precision='32-true' | 'bf16-mixed' | 'bf16-true' |"
                " '16-mixed')`, or `zero_stage=0` to keep this plugin."
            )
        precision = plugin.precision
        self.zero.deepspeed_config(precision, None)  # an unsupported precision fails here, before launch
        return ZeroPrecision(precision)

    def _initialize_zero(self, trainer: Trainer, module: LightningModule) -> None:
        """Hand the parallelized module and the user's optimizer to ``deepspeed.initialize``."""
        import deepspeed

        if len(self.optimizers) != 1 or len(self.lr_scheduler_configs) > 1:  # type: ignore[attr-defined]
            raise ValueError(
                f"`zero_stage={self.zero.stage}`: `configure_optimizers` returned {len(self.optimizers)} optimizers"  # type: ignore[attr-defined]
                f" and {len(self.lr_scheduler_configs)} schedulers; DeepSpeed drives exactly one optimizer (and at"  # type: ignore[attr-defined]
                " most one scheduler). Put all parameter groups into one optimizer."
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise ValueError(
                "`Trainer(gradient_clip_algorithm='value')` with ZeRO: DeepSpeed clips by the global norm only."
                " Use `gradient_clip_algorithm='norm'`."
            )
        _deepspeed_environment(self)
        self._zero_mpu = MeshParallelUnit(self.device_mesh)  # type: ignore[attr-defined]
        deepspeed.init_distributed(
            dist_backend=self._process_group_backend,  # type: ignore[attr-defined]
            auto_mpi_discovery=False,
            timeout=self._timeout,  # type: ignore[attr-defined]
        )
        optimizer = self.optimizers[0]  # type: ignore[attr-defined]
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]  # type: ignore[attr-defined]
        if self.zero.offload is not None:
            optimizer = offload_optimizer(optimizer, schedulers)
        config = self.zero.deepspeed_config(self.precision_plugin.precision, trainer.gradient_clip_val)  # type: ignore[attr-defined]
        engine, zero_optimizer, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            config=config,
            mpu=self._zero_mpu,
            dist_init_required=False,
        )
        self.zero_engine = engine
        self.optimizers = [zero_optimizer]  # type: ignore[attr-defined]
        if self.pipeline_runner is None:  # type: ignore[attr-defined]
            self.model = engine  # type: ignore[attr-defined]  # steps run through engine.forward
        rank_zero_info(
            f"{type(self).__name__}: ZeRO stage {self.zero.stage}"
            + (f", offload {self.zero.offload}" if self.zero.offload else "")
            + f", sharded over {self._zero_mpu.get_data_parallel_world_size()} data-parallel ranks"
        )

    def _prepare_for_zero(self, module: LightningModule) -> None:
        """Before the optimizer exists: plain parameters for DeepSpeed, expert gradient scaling."""
        if self.dims.tp_enabled:  # type: ignore[attr-defined]
            local_shard_parameters(module)
        runner = self.pipeline_runner  # type: ignore[attr-defined]
        parameters = list(runner.parameters) if runner is not None else list(module.parameters())
        expert_ids = getattr(self, "_expert_parameter_ids", set())
        mark_model_parallel(p for p in parameters if id(p) in expert_ids)
        scaling = self._zero_expert_sync(parameters)
        if runner is None:
            self._manual_gradient_sync = scaling
        elif scaling is not None:
            self._gradient_sync.groups.append(scaling)  # type: ignore[attr-defined]

    def _zero_expert_sync(self, parameters: list[torch.nn.Parameter]) -> ExpertGradientScaling | None:
        """Expert parallelism under ZeRO-1: what must happen to the gradients before ZeRO reduces them."""
        if not self.dims.ep_enabled:  # type: ignore[attr-defined]
            return None
        expert_ids = self._expert_parameter_ids  # type: ignore[attr-defined]
        trainable = [p for p in parameters if p.requires_grad]
        return ExpertGradientScaling(
            GradientGroup([p for p in trainable if id(p) not in expert_ids], self.device_mesh["ep"].get_group(),  # type: ignore[attr-defined]
                          self.dims.expert_parallel),  # type: ignore[attr-defined]
            [p for p in trainable if id(p) in expert_ids],
            self.dims.expert_parallel,  # type: ignore[attr-defined]
        )  # fmt: skip


@dataclass
class ExpertGradientScaling:
    """Dense gradients averaged over ``ep``; expert gradients divided by ``ep``.

    ZeRO then averages both over ``dp_replicate``: dense weights end up averaged over the whole
    ``dp`` (= ``dp_replicate x ep``), experts summed over ``dp_replicate`` and divided by ``dp``,
    which is what the loss (a mean over the global batch) asks of each (docs/experts.md).
    """

    dense: GradientGroup
    experts: list[torch.nn.Parameter]
    expert_parallel: int

    def reduce(self) -> None:
        self.dense.reduce()
        for param in self.experts:
            if param.grad is not None:
                param.grad.div_(self.expert_parallel)

    __call__ = reduce
