"""Context parallelism in the recipe: the split's state, its check on one step, its hooks.

Three functions because tensor parallelism falls between them (``context_parallel/hooks.py`` says
why): :func:`verify` on the whole model (one real step of the user's code), :func:`enter` after
the pipeline cut, :func:`leave` after sharding.
"""

from __future__ import annotations

from typing import cast

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from lightning_parallel.config.parallel_config import ContextParallelConfig
from lightning_parallel.context_parallel import (
    ContextState,
    SequenceSplit,
    install_entry,
    install_exit,
    verify_blocks,
)
from lightning_parallel.context_parallel.attention import Mode
from lightning_parallel.context_parallel.local_tokens import LocalTokensMode
from lightning_parallel.context_parallel.verify import Captured
from lightning_parallel.experts.layer import MoE
from lightning_parallel.mesh import Axis
from lightning_parallel.pipeline.stages import SkippedBlock

NO_BLOCKS = (
    "`context_parallel={degree}`: no repeated block list was found in the model, so there is no stack to split the"
    " sequence through. Context parallelism needs the model's transformer blocks in an `nn.ModuleList`."
)


def context_state(
    config: ContextParallelConfig, mesh: DeviceMesh, *, sequence_parallel: bool
) -> ContextState:
    """``sequence_parallel``: between blocks, the residual stream is also split over ``tp``."""
    cp = mesh[Axis.CP]
    between = config.degree * (mesh[Axis.TP].size() if sequence_parallel else 1)
    split = SequenceSplit(config.degree, cp.get_local_rank())
    return ContextState(split, cp.get_group(), cast(Mode, config.mode), between_blocks=between)


def refuse_dropping_experts(module: nn.Module, degree: int) -> None:
    """An MoE with a capacity drops assignments by their place in the batch's queues: split over context
    ranks, which tokens a rank routes together changes, and so do the drops (whatever the data)."""
    for name, layer in module.named_modules():
        if isinstance(layer, MoE) and layer.capacity_factor is not None:
            raise ValueError(
                f"`context_parallel={degree}` with the MoE layer `{name}` (capacity_factor={layer.capacity_factor}) is"
                " not supported: the assignments an expert drops depend on which tokens are routed together, which"
                " splitting the sequence changes. Use `capacity_factor=None` (dropless) for context parallelism, or"
                " `context_parallel=1`."
            )


def verify(
    module: nn.Module,
    state: ContextState,
    blocks: list[str],
    captured: dict[str, Captured] | None,
    tensor_parallel: int,
) -> None:
    """Refuse, before anything is changed, a model the split would silently change."""
    if not blocks:
        raise ValueError(NO_BLOCKS.format(degree=state.split.degree))
    refuse_dropping_experts(module, state.split.degree)
    if captured is None:
        rank_zero_warn("No batch available before training: the context-parallel split was not verified.")
        return
    for line in verify_blocks(module, captured, state, tensor_parallel):
        rank_zero_info(line)


def _skipped(block: nn.Module) -> bool:
    return isinstance(block, SkippedBlock)


def enter(module: nn.Module, blocks: list[str], state: ContextState) -> list[RemovableHandle]:
    return install_entry(module, blocks, state, skip=_skipped)


def leave(
    module: nn.Module, blocks: list[str], state: ContextState
) -> tuple[list[RemovableHandle], LocalTokensMode]:
    """The exit's hook, and the follower of this rank's tokens that training steps enter."""
    tokens = LocalTokensMode(state.split, state.group)
    handles = install_exit(module, blocks, state, skip=_skipped, tokens=tokens)
    rank_zero_info(
        f"Context parallelism: sequences split over {state.split.degree} ranks ({state.mode} attention,"
        f" load-balanced causal chunks), blocks {blocks[0]}..{blocks[-1]}; in training steps the final norm, the"
        " head and F.cross_entropy run on each rank's tokens"
    )
    return handles, tokens
