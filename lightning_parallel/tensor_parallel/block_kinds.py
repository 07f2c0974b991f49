"""Which blocks of a stack are alike: the unit the setup verifications check once each.

One block class can hold layers that run differently: Gemma 2/3, GPT-OSS and Llama 4 alternate sliding,
chunked and full attention inside one decoder-layer class; hybrids (Qwen3-Next, MiniMax, LFM) build a
linear-attention or convolution layer from the same class as their attention layers; MoE models put
experts in some layers only. Verifying the first block of each *class* would leave the others unchecked,
and a plan that is wrong for them would train silently wrong. A block's kind is therefore its structure:
the class and the plain attributes of every module in it (the window, the layer type, a flag), and the
shape of every parameter. Attributes that only number the layer (``layer_idx``) are left out, so a
uniform stack is still one kind and costs one check.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

_PLAIN = (bool, int, float, str, type(None))
_NUMBERING = re.compile(r"(^|_)(idx|index|layer_id|layer_number|layer_num|block_idx|block_id|depth)$", re.I)


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list)) and len(value) <= 16 and all(isinstance(v, _PLAIN) for v in value)


def block_signature(block: nn.Module) -> tuple:
    """What two blocks must share to run alike: classes, plain attributes and parameter shapes, module by module."""
    parts = []
    for name, module in block.named_modules():
        attributes = tuple(
            sorted(
                (key, repr(value))
                for key, value in vars(module).items()
                if not key.startswith("_") and not _NUMBERING.search(key) and _plain(value)
            )
        )
        shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
        parts.append((name, type(module).__qualname__, attributes, shapes))
    return tuple(parts)


def first_block_of_each_kind(module: nn.Module, block_names: list[str]) -> dict[str, nn.Module]:
    """The first block of every distinct kind (:func:`block_signature`), by name, in stack order."""
    firsts: dict[tuple, str] = {}
    for name in block_names:
        firsts.setdefault(block_signature(module.get_submodule(name)), name)
    return {name: module.get_submodule(name) for name in firsts.values()}


def same_kind(a: nn.Module, b: nn.Module) -> bool:
    return a is b or (type(a) is type(b) and block_signature(a) == block_signature(b))
