"""Where the sequence split enters and leaves an unchanged model: hooks on its repeated blocks.

Entering the first block, the hidden state is cut to this rank's tokens; entering every block,
the other tensors it is handed that carry the sequence (rotary tables, position ids,
``cache_position``) are cut alike, because they were computed by model-level code for the whole
sequence; masks stay whole (the attention reads what it needs). Leaving the last block, in a
training step the hidden state stays split and is followed through the final norm, the head and
the loss (``local_tokens.py``); elsewhere it is gathered whole again. Either way model-level code
after the stack computes what one process computes. Every block's attention calls are routed over
the split (``attention.py``).

Installed in two parts around tensor parallelism (``parallelize/recipe.py``): the entering hooks
before its sequence-parallel region (the split over ``cp`` comes first, the split over ``tp`` of
what remains second) and after the pipeline's injection of the received activation; the leaving
hook after the sequence-parallel region's own gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_parallel.context_parallel.attention import ContextState, route_attention
from lightning_parallel.context_parallel.local_tokens import LocalTokensMode
from lightning_parallel.context_parallel.split import gather, scatter, scatter_side_inputs
from lightning_parallel.tensor_parallel.regions import find_hidden, map_first_tensor, replace_hidden


def split_block_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], state: ContextState, *, first: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block's arguments cut to this rank's tokens (the hidden state too when ``first``)."""
    where, hidden = find_hidden(args, kwargs)
    if first:
        length = hidden.shape[1]
    elif isinstance(hidden, DTensor):  # its shape is global over tp already
        length = hidden.shape[1] * state.split.degree
    else:
        length = hidden.shape[1] * (state.between_blocks or state.split.degree)
    state.split.check(length)
    args = tuple(a if i == where else scatter_side_inputs(a, state.split, length) for i, a in enumerate(args))
    kwargs = {k: v if k == where else scatter_side_inputs(v, state.split, length) for k, v in kwargs.items()}
    if first:
        return replace_hidden(args, kwargs, where, scatter(hidden, state.split, dim=1))
    return args, kwargs


def _enter(state: ContextState, *, first: bool) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return split_block_inputs(args, kwargs, state, first=first)

    return hook


def install_entry(
    module: nn.Module, blocks: list[str], state: ContextState, skip: Callable[[nn.Module], bool]
) -> list[RemovableHandle]:
    """Split the inputs of every block this rank runs (``skip``: blocks other pipeline stages hold)."""
    handles = []
    for index, name in enumerate(blocks):
        block = module.get_submodule(name)
        if skip(block):
            continue
        handles.append(block.register_forward_pre_hook(_enter(state, first=index == 0), with_kwargs=True))
        route_attention(block, state)
    return handles


def install_exit(
    module: nn.Module,
    blocks: list[str],
    state: ContextState,
    skip: Callable[[nn.Module], bool],
    tokens: LocalTokensMode | None = None,
) -> list[RemovableHandle]:
    """Leaving the model's last block (on the rank that runs it): in a training step followed by ``tokens``
    (``local_tokens.py``: the head and the loss on this rank's tokens), elsewhere gathered whole."""
    last = module.get_submodule(blocks[-1])
    if skip(last):
        return []

    def followed_or_whole(hidden: torch.Tensor) -> torch.Tensor:
        if tokens is not None and tokens.active and not isinstance(hidden, DTensor):
            return tokens.track_exit(hidden)
        return gather(hidden, state.split, state.group)

    def leave(block: nn.Module, args: Any, output: Any) -> Any:
        return map_first_tensor(output, followed_or_whole)

    return [last.register_forward_hook(leave)]
