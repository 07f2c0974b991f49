"""Activation memory savers in the recipe: recomputation (activation checkpointing) and the saved-tensor saver.

After tensor parallelism and the pipeline cut (the recomputed modules are the sharded, cut
ones) and before ``compile`` and data parallelism (which wrap them). Around every training
step the strategy routes saved activations through the saver (``memory.saved_tensors_context``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.config import MemorySaverConfig
from lightning_parallel.experts import AuxLossCollector
from lightning_parallel.memory.checkpointing import (
    CheckpointingConfig,
    StateCapture,
    apply_activation_checkpointing,
    select_modules,
)
from lightning_parallel.memory.saved_tensors import ActivationSaver, RunningForward
from lightning_parallel.pipeline.stages import SkippedBlock, StageLayout, StageRuntime
from lightning_parallel.tensor_parallel import ParallelPlan


def apply_memory_savers(
    module: nn.Module,
    config: MemorySaverConfig,
    blocks: list[str],
    plan: ParallelPlan | None,
    aux_losses: AuxLossCollector | None,
    runtime: StageRuntime | None,
    *,
    stages: StageLayout | None = None,
    compiled: bool = False,
) -> ActivationSaver | None:
    """Patch the recomputed modules and build the saver; returns the saver (None without one).

    ``blocks`` are all the model's blocks (those other stages hold too, so "every k-th block"
    means the same blocks under every layout); ``runtime``, ``stages``: the pipeline's, when cut into stages.
    ``compiled``: the blocks are compiled next. Their recomputation then replays the traced graph, which
    reads no stage flag, and dynamo accepts no recomputation context but dispatch modes; so the
    pipeline's stage restore (needed by the eager recomputation of a gated block) is left out.
    """
    kept_indices = [i for i, n in enumerate(blocks) if not isinstance(module.get_submodule(n), SkippedBlock)]
    kept = [module.get_submodule(blocks[i]) for i in kept_indices]
    notes = []
    saver = None
    if config.checkpointing is not None:
        _check_tensor_parallel_containers(module, config.checkpointing, blocks, plan)
        _check_aux_losses(module, config.checkpointing, blocks, aux_losses)
        done = apply_activation_checkpointing(
            module,
            config.checkpointing,
            blocks,
            skip=lambda m: isinstance(m, SkippedBlock),
            capture_state=_pipeline_state_capture(runtime) if runtime is not None and not compiled else None,
        )
        notes.append(f"activation checkpointing {config.checkpointing.describe()} on {len(done)} module(s)")
    if config.saves_tensors:
        saver = ActivationSaver(
            compression=config.compression,  # type: ignore[arg-type]
            offload=config.offload,
            parameters=list(module.parameters()),
            blocks=kept,
            block_stages=[stages.stage_of_block(i) for i in kept_indices] if stages is not None else None,
            running=_running_forward(runtime) if runtime is not None and stages is not None else None,
        )
        notes.append(
            f"saved activations: offload={'on' if config.offload else 'off'}, compression={config.compression}"
        )
    if notes:
        rank_zero_info("HybridParallelStrategy: " + "; ".join(notes))
    return saver


def _check_tensor_parallel_containers(
    module: nn.Module, config: CheckpointingConfig, blocks: list[str], plan: ParallelPlan | None
) -> None:
    if plan is None or not config.patterns:
        return
    sharded = {c.name for c in plan.containers}
    for name, _ in select_modules(module, config, blocks):
        if name in sharded:
            raise ValueError(
                f"`activation_checkpointing_policy` selects {name!r}, a tensor-parallel attention/MLP module:"
                " its input is converted to a DTensor by hooks on the module itself, which a recomputation"
                " of its forward alone would skip. Select the block that contains it (e.g."
                f" {name.rsplit('.', 1)[0]!r}) or a module inside it."
            )


def _check_aux_losses(
    module: nn.Module, config: CheckpointingConfig, blocks: list[str], collector: AuxLossCollector | None
) -> None:
    """Recomputing an MoE block whose auxiliary loss is collected would record that loss twice."""
    if collector is None:
        return
    moe = {id(info.block): info.name for info in collector.blocks}
    for name, selected in select_modules(module, config, blocks):
        inside = [moe[id(m)] for m in selected.modules() if id(m) in moe]
        if inside:
            raise ValueError(
                f"`activation_checkpointing={config.mode!r}` recomputes {name!r}, which holds the MoE block"
                f" {inside[0]!r} whose auxiliary loss the strategy collects (`moe_aux_loss_coef`, or this"
                " library's MoE layers under pipeline parallelism): the recomputation in backward would run"
                " its router again and record the loss a second time. Leave `moe_aux_loss_coef=None`, or"
                " recompute other modules (`activation_checkpointing='selective',"
                " activation_checkpointing_policy=[patterns]`), or `activation_checkpointing=None`."
            )


def _running_forward(runtime: StageRuntime) -> RunningForward:
    def running() -> tuple[int, int] | None:
        stage, micro_batch = runtime.active_stage, runtime.active_micro_batch
        return None if stage is None or micro_batch is None else (stage, micro_batch)

    return running


def _pipeline_state_capture(runtime: StageRuntime) -> StateCapture:
    """For pipeline stages: the recomputation sees the stage that was active in the forward pass."""

    def capture() -> Any:
        stage = runtime.active_stage

        @contextmanager
        def restore() -> Iterator[None]:
            previous, runtime.active_stage = runtime.active_stage, stage
            try:
                yield
            finally:
                runtime.active_stage = previous

        return restore

    return capture
