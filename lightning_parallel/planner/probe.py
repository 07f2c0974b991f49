"""What a block's MLP and norms save for backward, per token, measured by running them on the meta device.

Norms and activation functions are where models differ most and formulas guess worst: torch's
``LayerNorm`` keeps its input and two statistics, a Hugging Face ``RMSNorm`` written in Python keeps
an fp32 copy and its normalised output too, GPT-2's tanh GELU keeps four intermediates where
``nn.GELU`` keeps one. Running the module itself on a meta tensor (no memory, no data) under
``saved_tensors_hooks`` counts exactly what autograd would keep, by storage, as the project's
``SavedTensorCounter`` does on real tensors; weights are left out. Attention is not probed: on the
meta device ``scaled_dot_product_attention`` takes the math path, whatever the GPU will run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lightning_parallel.memory.counting import kept_as_is

__all__ = ["SavedPerToken", "saved_per_token"]

_TOKENS = 8  # enough to tell per-token tensors from per-sequence ones; the count is divided by it


@dataclass(frozen=True)
class SavedPerToken:
    """Saved for backward per token: floating-point elements (their size is the precision's) and other bytes
    (dropout masks, indices)."""

    float_elements: float
    other_bytes: float


def saved_per_token(module: nn.Module, width: int) -> SavedPerToken | None:
    """Run ``module`` on a meta ``(1, tokens, width)`` input that needs a gradient; None if it cannot run there.

    A module with real weights is probed as a meta copy (the user's module is not touched).
    """
    if any(p.device.type != "meta" for p in module.parameters()):
        module = copy.deepcopy(module).to("meta")
    weights = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in weights and key not in seen:
            seen[key] = (storage.nbytes(), tensor.is_floating_point())
        return kept_as_is(tensor)  # no backward runs: with its grad_fn the graph would keep itself

    was_training = module.training
    module.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(torch.empty(1, _TOKENS, width, device="meta", requires_grad=True))
    except Exception:  # a module that needs more than one tensor: the formulas stand
        return None
    finally:
        module.train(was_training)
    floats = sum(nbytes for nbytes, floating in seen.values() if floating) / 4  # the probe runs in fp32
    others = sum(nbytes for nbytes, floating in seen.values() if not floating)
    return SavedPerToken(floats / _TOKENS, others / _TOKENS)
