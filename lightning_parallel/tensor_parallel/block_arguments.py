"""A block's per-token arguments under sequence parallelism: cut with the hidden state, whole again where the
sequence is.

Models hand every block tensors with one entry per token besides the hidden state: Gemma 3n's and Gemma 4's
per-layer inputs (made once at model level), rotary tables, position ids. Under sequence parallelism the block
holds its slice of the sequence, and its own per-token code (a per-layer input gate) must meet the matching
slice of those tensors; the attention and MLP modules, and the modules left whole that run on the whole
sequence, gather the hidden state and must meet them whole. So, entering each block, every argument shaped
``(batch, sequence, ...)`` like the gathered hidden state is cut to this rank's slice (its gradient gathered back
in backward, as the residual stream's is), and a module that gathers gets the whole tensor again
(:func:`whole_arguments`; the hooks are ``regions.install_block_argument_slices``). Masks ``(batch, 1, queries, keys)`` and anything else not so shaped pass untouched.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["forget_slices", "map_items", "remember_slice", "whole_arguments"]

_SLICED: dict[
    int, tuple[torch.Tensor, torch.Tensor]
] = {}  # id(slice) -> (the slice, the whole), one block call


def whole_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with each per-token tensor the block was cut to its slice given whole again."""
    if not _SLICED:
        return args, kwargs

    def whole(value: Any) -> Any:
        known = _SLICED.get(id(value)) if isinstance(value, torch.Tensor) else None
        return known[1] if known is not None and known[0] is value else value

    return tuple(map_items(whole, a) for a in args), {k: map_items(whole, v) for k, v in kwargs.items()}


def map_items(fn: Any, value: Any) -> Any:
    """``fn`` on a value, and on the items of a tuple or list value (rotary ``(cos, sin)``)."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(fn(item) for item in value)
    return fn(value)


def remember_slice(piece: torch.Tensor, whole: torch.Tensor) -> None:
    _SLICED[id(piece)] = (piece, whole)


def forget_slices() -> None:
    """The block's call ended: its slices are no one's arguments any more."""
    _SLICED.clear()
