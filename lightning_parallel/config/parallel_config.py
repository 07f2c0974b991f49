"""What the user asked ``HybridParallelStrategy`` for, resolved: one object of small grouped dataclasses.

Built and checked once, at construction, by ``config/validation.py`` (the one module with every
argument check and every refused combination); read by the parallelize recipe
(``parallelize/recipe.py``) and the strategy's hooks, never changed afterwards. The groups that
a package below takes as its own input live in that package (``PipelineConfig`` in
``pipeline/setup.py``, ``ZeroArguments`` in ``zero/arguments.py``, ``CheckpointingConfig`` in
``memory/checkpointing.py``); the rest are here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.comm.compression import GradientCompression
from lightning_parallel.memory.checkpointing import CheckpointingConfig
from lightning_parallel.pipeline.setup import PipelineConfig
from lightning_parallel.tensor_parallel.plan import ParallelPlan
from lightning_parallel.zero.arguments import ZeroArguments

PlanArg = Literal["auto"] | dict[str, ParallelStyle | str] | ParallelPlan
PathLike = str | os.PathLike
PIPELINE_BOUNDARIES_KEY = "pipeline_boundaries"
"""The ``plan=`` dict key that holds the pipeline's stage boundaries instead of a module pattern."""


@dataclass(frozen=True)
class TensorParallelConfig:
    """How each layer's matmuls are sharded."""

    degree: int | Literal["auto"] = 1
    """``tensor_parallel=``: ranks per tensor-parallel group; ``"auto"``: the devices of a node."""
    sequence_parallel: bool = False
    """``sequence_parallel=``: also shard norm/dropout activations along the sequence."""
    plan: PlanArg = "auto"
    """``plan=``: ``"auto"``, a dict of module-name patterns (without ``pipeline_boundaries``), or a plan."""
    verify_plan: bool = True
    """``verify_plan=``: run one block of each class sharded and unsharded at setup."""
    loss_parallel: bool | None = None
    """``loss_parallel=``: None (default) computes ``F.cross_entropy`` on a sharded head's logits on the
    vocabulary shards (``tensor_parallel/vocab_loss.py``); False gathers the logits; True keeps them a
    DTensor for the whole training step (torch's ``loss_parallel()``)."""


@dataclass(frozen=True)
class ExpertConfig:
    """Mixture-of-Experts: where experts live and which auxiliary losses the strategy adds."""

    expert_parallel: int = 1
    """``expert_parallel=``: ranks the experts are sharded over, carved out of the data-parallel ranks."""
    aux_loss_coef: float | None = None
    """``moe_aux_loss_coef=``: weight of the Switch load-balancing loss the strategy adds; None: off."""
    z_loss_coef: float = 0.0
    """``moe_z_loss_coef=``: weight of the router z-loss the strategy adds."""


@dataclass(frozen=True)
class ContextParallelConfig:
    """Sequences split across ranks through the whole block stack, attention included."""

    degree: int = 1
    """``context_parallel=``: ranks that hold different tokens of each sequence, carved out of the data-parallel ranks."""
    mode: str = "ring"
    """``context_parallel_mode=``: ``"ring"`` (keys and values rotate) or ``"ulysses"`` (all-to-all to a head split)."""

    @property
    def enabled(self) -> bool:
        return self.degree > 1


@dataclass(frozen=True)
class MemorySaverConfig:
    """Memory savers on activations, and the bandwidth saver on gradients."""

    checkpointing: CheckpointingConfig | None = None
    """``activation_checkpointing=`` and its policy: what is recomputed in backward; None: nothing."""
    offload: bool = False
    """``activation_offload=``: keep saved activations in host memory until backward."""
    compression: str | None = None
    """``activation_compression=``: ``"bf16"`` or ``"fp8"`` storage of saved activations; None: as computed."""
    gradient_compression: GradientCompression | None = None
    """``gradient_compression=``: ``"bf16"``/``"fp16"`` or a ``PowerSGD`` on the data-parallel mean."""

    @property
    def saves_tensors(self) -> bool:
        return self.offload or self.compression is not None


@dataclass(frozen=True)
class ParallelConfig:
    """Every argument of ``HybridParallelStrategy`` that shapes the parallel job, validated."""

    tensor: TensorParallelConfig
    """Tensor and sequence parallelism, the plan and its verification."""
    pipeline: PipelineConfig | None
    """Pipeline stages, schedule and micro-batches; None without pipeline parallelism."""
    experts: ExpertConfig
    """Expert parallelism and the MoE auxiliary losses."""
    zero: ZeroArguments
    """DeepSpeed ZeRO stage, offload and raw DeepSpeed keys (stage 0: off)."""
    memory: MemorySaverConfig
    """Activation checkpointing, offload and compression; gradient compression."""
    compile: bool = False
    """``compile=``: ``torch.compile`` each block this rank runs, after sharding."""
    init_weights: Path | None = None
    """``init_weights=``: a single-file state dict loaded after sharding, each rank its own part."""
    context: ContextParallelConfig = ContextParallelConfig()
    """Context parallelism: the sequence split through attention (degree 1: off)."""
