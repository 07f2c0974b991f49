"""The strategy's constructor arguments, read back from the validated configuration.

``HybridParallelStrategy(...)`` validates its arguments into one :class:`ParallelConfig`
(``config/validation.py``); these typed, read-only properties give each argument back under its own name
(``trainer.strategy.expert_parallel``), so user code and tests never reach into the configuration's layout.
What setup made of them (the plan, the sharded loss, the stages) lives on the strategy itself.
"""

from __future__ import annotations

from pathlib import Path

from lightning_parallel.config.parallel_config import MemorySaverConfig, ParallelConfig
from lightning_parallel.zero.arguments import ZeroArguments

__all__ = ["AskedArguments"]


class AskedArguments:
    """Read-only views of ``self.config`` by argument name (a mixin of the strategy)."""

    config: ParallelConfig

    @property
    def sequence_parallel(self) -> bool:
        """``sequence_parallel=``: norms and dropout on sequence shards."""
        return self.config.tensor.sequence_parallel

    @property
    def pipeline_parallel(self) -> int:
        """``pipeline_parallel=``: pipeline stages (1: none)."""
        return self.config.pipeline.pipeline_parallel if self.config.pipeline else 1

    @property
    def expert_parallel(self) -> int:
        """``expert_parallel=``: ranks the experts are split over."""
        return self.config.experts.expert_parallel

    @property
    def context_parallel(self) -> int:
        """``context_parallel=``: ranks each sequence is split over inside attention."""
        return self.config.context.degree

    @property
    def moe_aux_loss_coef(self) -> float | None:
        """``moe_aux_loss_coef=``: the load-balancing loss's weight (None: off)."""
        return self.config.experts.aux_loss_coef

    @property
    def moe_z_loss_coef(self) -> float:
        """``moe_z_loss_coef=``: the router z-loss's weight."""
        return self.config.experts.z_loss_coef

    @property
    def verify_plan(self) -> bool:
        """``verify_plan=``: check the tensor-parallel plan on one block of each kind at setup."""
        return self.config.tensor.verify_plan

    @property
    def compile(self) -> bool:
        """``compile=``: each block compiled after sharding."""
        return self.config.compile

    @property
    def init_weights(self) -> Path | None:
        """``init_weights=``: the state dict loaded after sharding."""
        return self.config.init_weights

    @property
    def zero(self) -> ZeroArguments:
        """``zero_stage=``, ``offload=`` and the DeepSpeed keys, resolved."""
        return self.config.zero

    @property
    def zero_enabled(self) -> bool:
        """Whether a ZeRO stage (1-3) is on."""
        return self.config.zero.enabled

    @property
    def memory_savers(self) -> MemorySaverConfig:
        """Activation checkpointing, offload and compression; gradient compression."""
        return self.config.memory
