"""The model's own attention calls, routed through the sequence split: ring or all-to-all.

Unchanged model code calls ``F.scaled_dot_product_attention(q, k, v, ...)`` on this rank's tokens.
A ``TorchFunctionMode`` entered around each block's forward (:func:`route_attention`) catches the
call and answers it over the whole sequence (``ring.py`` or ``ulysses.py``); every other op runs
as it is. The mode is entered inside the block's forward, so activation checkpointing's
recomputation in backward is routed the same way.

Masks the model computed for the whole sequence reach attention whole (``split.sequence_dim``
leaves tensors with two sequence-long dims alone): the ring reads the rows of this rank's queries
and the columns of each visiting chunk (``blocks.py``), the all-to-all sees the whole sequence
and uses the mask as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_parallel.context_parallel.blocks import ChunkPairs
from lightning_parallel.context_parallel.ring import ring_attention
from lightning_parallel.context_parallel.split import SequenceSplit
from lightning_parallel.context_parallel.ulysses import ulysses_attention

Mode = Literal["ring", "ulysses"]
MODES: tuple[str, ...] = ("ring", "ulysses")


@dataclass
class ContextState:
    """The split and group every routed attention call uses, and what the calls saw (for the setup check)."""

    split: SequenceSplit
    group: dist.ProcessGroup
    mode: Mode
    between_blocks: int = 0
    """Ranks sharing each sequence between two blocks: ``C``, times ``tp`` under sequence parallelism (0: ``C``)."""
    calls: int = 0
    heads: set[int] = field(default_factory=set)


def attend(
    state: ContextState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over the whole sequence, from this rank's tokens."""
    if dropout_p:
        raise ValueError(
            f"Attention dropout (`dropout_p={dropout_p}`) under `context_parallel` is not supported: the ring"
            " would draw a different dropout mask than one process. Set the model's attention dropout to 0."
        )
    if query.dim() != 4 or key.shape[-2] != query.shape[-2]:
        raise ValueError(
            "Context parallelism routes self-attention over the split sequence: it expects queries, keys and values"
            f" of shape (B, H, T / C, D) with as many keys as queries; got {tuple(query.shape)} and"
            f" {tuple(key.shape)}. Cross-attention or cached decoding cannot run under `context_parallel`."
        )
    if attn_mask is not None and is_causal:
        raise ValueError(
            "scaled_dot_product_attention was called with both `attn_mask` and `is_causal=True`, which torch"
            " itself refuses; fold the causal mask into `attn_mask`."
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{query.shape[1]} query heads cannot share {key.shape[1]} key/value heads: grouped-query attention"
            " needs the key/value heads to divide the query heads."
        )
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(
            f"{query.shape[1]} query heads and {key.shape[1]} key heads without `enable_gqa=True`:"
            " scaled_dot_product_attention itself would refuse these shapes."
        )
    state.calls += 1
    state.heads.add(query.shape[1])
    length = query.shape[-2] * state.split.degree
    if state.mode == "ulysses":
        return ulysses_attention(
            query,
            key,
            value,
            attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            split=state.split,
            group=state.group,
        )
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    pairs = ChunkPairs(state.split, length, is_causal, attn_mask)
    return ring_attention(query, key, value, pairs, scale, state.group)


class _RouteAttention(TorchFunctionMode):
    def __init__(self, state: ContextState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is F.scaled_dot_product_attention:
            return attend(self.state, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def route_attention(block: nn.Module, state: ContextState) -> None:
    """Run ``block``'s forward with its attention calls answered over the whole sequence."""
    forward = block.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _RouteAttention(state):
            return forward(*args, **kwargs)

    block.forward = run  # type: ignore[method-assign]
