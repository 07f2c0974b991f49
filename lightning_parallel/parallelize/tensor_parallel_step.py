"""Tensor and sequence parallelism in the recipe: build the plan, verify it on one step, shard.

Three functions because the pipeline cut falls between them: the plan is built and verified on
the whole model (one real step of the user's code), then applied to what this rank keeps.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from lightning_parallel.config import TensorParallelConfig
from lightning_parallel.pipeline.setup import filter_plan_to_kept_modules
from lightning_parallel.plans import ParallelPlan, auto_plan, plan_from_dict
from lightning_parallel.tensor_parallel import apply_tensor_parallel, verify_and_choose_modes
from lightning_parallel.tensor_parallel.captured_inputs import Captured
from lightning_parallel.tensor_parallel.loss_parallel import (
    LossParallelState,
    install_head_hook,
    sharded_head_style,
)
from lightning_parallel.tensor_parallel.plan import record_parameter_shards
from lightning_parallel.tensor_parallel.vocab_loss import ShardedLogitsMode

log = logging.getLogger(__name__)


def build_plan(module: nn.Module, config: TensorParallelConfig, tensor_parallel: int) -> ParallelPlan:
    """The plan for ``tensor_parallel`` ranks; pure, so a model that cannot be sharded fails on every rank alike."""
    sequence_parallel = config.sequence_parallel and tensor_parallel > 1
    if isinstance(config.plan, ParallelPlan):
        return config.plan
    if isinstance(config.plan, dict):
        return plan_from_dict(module, config.plan, tensor_parallel, sequence_parallel=sequence_parallel)
    return auto_plan(module, tensor_parallel, sequence_parallel=sequence_parallel)


def first_block_of_each_class(module: nn.Module, block_names: list[str]) -> dict[str, nn.Module]:
    """The blocks the verifications run (the plan's, the context split's): the first of every distinct class."""
    firsts: dict[type, str] = {}
    for name in block_names:
        firsts.setdefault(type(module.get_submodule(name)), name)
    return {name: module.get_submodule(name) for name in firsts.values()}


def verify_plan(
    module: nn.Module, plan: ParallelPlan, tp_mesh: DeviceMesh, captured: dict[str, Captured]
) -> None:
    """Each verified block class sharded against unsharded on the inputs the sampled step gave it."""
    for line in verify_and_choose_modes(module, plan, tp_mesh, captured):
        plan.notes.append(line)


def check_row_layouts(plan: ParallelPlan, zero_engine: str | None) -> None:
    """Refuse ZeRO where it cannot keep a weight stored in a row layout (``tensor_parallel/row_layout.py``).

    DeepSpeed's engine flattens the local shards and writes its own checkpoints, which would hold the
    stored rows; FSDP2 replaces the parameters whose copies' gradients must be summed over the ranks.
    """
    for name, style in plan.styles.items():
        layout = getattr(style, "row_layout", None)
        if layout is None or zero_engine is None:
            continue
        if zero_engine == "deepspeed" or layout.duplicated:
            why = (
                "k/v heads fewer than the tensor-parallel ranks, each stored on several of them"
                if layout.duplicated
                else "a fused q|k|v projection of unequal widths, stored in another row order"
            )
            raise ValueError(
                f"`{name}` is {why}; ZeRO ({zero_engine}'s engine) cannot keep that layout. Use"
                + (" a tensor_parallel that divides its k/v heads," if layout.duplicated else "")
                + " zero_stage=0, or for the fused projection zero_stage=3 (torch's FSDP2)."
            )


def shard(
    module: nn.Module,
    plan: ParallelPlan,
    config: TensorParallelConfig,
    tp_mesh: DeviceMesh,
    *,
    pipelined: bool,
) -> tuple[list[Any], bool, LossParallelState]:
    """Shard what this rank holds (after a pipeline cut, other stages' modules are dropped from the plan).

    Returns the hooks it installed, whether the loss stays vocabulary-parallel as asked
    (``loss_parallel=True``; without a sharded head it falls back to gathered logits) and the state the
    head hook fills; by default (``loss_parallel=None``) that state holds the mode that computes
    ``F.cross_entropy`` on the head's shards (``tensor_parallel/vocab_loss.py``).
    """
    if pipelined:
        filter_plan_to_kept_modules(plan, module)
    loss_parallel = config.loss_parallel is True
    automatic = config.loss_parallel is None and plan.head is not None
    if (loss_parallel or automatic) and plan.head is not None:
        plan.styles[plan.head] = sharded_head_style()
    elif loss_parallel:
        rank_zero_warn("`loss_parallel=True`: no sharded output head was found; logits stay gathered.")
        loss_parallel = False
    hooks: list[RemovableHandle] = []
    if not plan.is_empty:  # nothing to shard: no sequence-parallel region either
        hooks = apply_tensor_parallel(module, plan, tp_mesh)
        log.info(
            "applied tensor parallelism (tp=%d, sp=%s) to %d modules",
            plan.tensor_parallel,
            plan.sequence_parallel,
            len(plan.styles),
        )
    state = LossParallelState(mode=ShardedLogitsMode() if automatic else None)
    if loss_parallel or automatic:
        assert plan.head is not None
        hooks.append(install_head_hook(module.get_submodule(plan.head), state))
    if automatic:
        rank_zero_info(
            f"Output head `{plan.head}` sharded over the vocabulary: F.cross_entropy on its logits runs on the"
            f" shards in training steps (each tensor-parallel rank keeps its 1/{tp_mesh.size()} of the logits for"
            " backward, not fp32 log-probabilities over the whole vocabulary); other uses of the logits see them"
            " gathered. Opt out: `loss_parallel=False`."
        )
    record_parameter_shards(plan, module)
    rank_zero_info(str(plan))
    return hooks, loss_parallel, state
