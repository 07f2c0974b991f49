"""``HybridParallelStrategy``'s arguments as one typed record: what the constructor hands to the
configuration (``config/validation.py: strategy_config``), by name and type, so that a renamed or retyped
argument fails where it is written (and in a type checker), not when a string key is read at run time.

The planner builds the same record for the layouts it proposes (``planner/layout.py: strategy_arguments``), so
that a layout it plans is one the strategy accepts: one rulebook. The defaults are the constructor's
(``tests/config/test_strategy_arguments.py`` holds them equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_parallel.config.parallel_config import PathLike, PlanArg
from lightning_parallel.zero.arguments import OffloadUpdate

__all__ = ["StrategyArguments"]


CheckpointPolicyArg = Literal["ops", "ops_alternate_matmuls"] | int | list[str] | None
"""``activation_checkpointing_policy``'s type: a named policy, every k-th block, or module-name patterns."""


@dataclass(frozen=True, kw_only=True)
class StrategyArguments:
    """Every argument of ``HybridParallelStrategy`` that shapes the job (the process group's backend and
    timeout go to Lightning's strategy)."""

    tensor_parallel: int | Literal["auto"] = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    context_parallel_mode: Literal["ring", "ulysses"] = "ring"
    moe_aux_loss_coef: float | None = None
    moe_z_loss_coef: float = 0.0
    sequence_parallel: bool = False
    micro_batches: int | None = None
    pipeline_schedule: str | None = None
    pipeline_virtual_stages: int | None = None
    zero_stage: int = 0
    offload: Literal["cpu", "nvme"] | None = None
    offload_path: str | None = None
    offload_ratio: float = 1.0
    zero_reshard: Literal["step", "micro_batch"] = "step"
    zero_engine: Literal["auto", "deepspeed", "fsdp2"] = "auto"
    offload_update: OffloadUpdate = "exact"
    zero_gather_dtype: Literal["stored", "compute"] = "stored"
    deepspeed_config: dict[str, Any] | None = None
    activation_checkpointing: Literal["full", "selective"] | None = None
    activation_checkpointing_policy: CheckpointPolicyArg = None
    activation_offload: bool = False
    activation_compression: Literal["bf16", "fp8"] | None = None
    gradient_compression: Any = None
    plan: PlanArg = "auto"
    verify_plan: bool = True
    compile: bool = False
    loss_parallel: bool | None = None
    save_distributed_checkpoint: bool = True
    init_weights: PathLike | None = None
