"""After the last block, the final norm, the head and the loss run on this rank's tokens only.

Leaving the block stack, the split could gather the whole sequence on every context rank (as it does
outside training steps): model-level code after the stack then sees what one process sees, but every
rank computes the final norm, the head and the loss for the whole sequence, and keeps their
activations for backward. At long context with a large vocabulary that is most of a rank's activations
(the loss's fp32 log-probabilities: ``sequence x vocabulary`` per sequence). Megatron and torchtitan
compute the head and the loss on each rank's tokens, with the labels split like the inputs; their
training loops split both. The user's training step here is unchanged, so the split follows the
hidden state instead (:class:`LocalTokensMode`, a ``TorchFunctionMode`` around the training step):

- functions that work on each token alone keep the tensor split (``per_token.py`` lists them: casts,
  arithmetic with a weight or a number, ``F.linear``, norms, softmaxes and reductions over features,
  reshapes that merge or split batch and sequence);
- ``F.cross_entropy`` and ``F.nll_loss`` with class-index targets of the whole sequence take this
  rank's targets, compute this rank's per-token losses, and gather those (one number per token) before
  the reduction the step asked for: the loss is the one-process loss, on every rank;
- anything else (slicing the sequence, ``argmax`` compared with the targets, a sum over tokens)
  receives the whole sequence, gathered once per tensor, and a line says which function needed it;
- ``shape``, ``size()``, ``numel()`` and ``len()`` answer for the whole sequence, as one process
  would, so the step's own reshapes (``logits.view(B * T, V)``) mean what they say.

Gradients keep the split's rule (``split.py``): what follows a gather is the same computation on
every rank, the gather's backward hands each rank ``C`` times its tokens' gradient, and the
data-parallel average over the context ranks sums the parts. The ranks of a context group make
the same choices in the same order (they depend on shapes and functions only), so their gathers
meet.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import tree_map
from lightning_parallel.context_parallel.per_token import (
    PASS_THROUGH,
    PROPERTIES,
    TokenLayout,
    function_name,
    in_place,
    per_token_call,
)
from lightning_parallel.context_parallel.split import SequenceSplit
from lightning_parallel.tensor_parallel.regions import flat_arguments

__all__ = ["LocalTokensMode", "TokenLayout"]

_LOSSES = (F.cross_entropy, F.nll_loss)
_ATEN_OPERATORS = (type(torch.ops.aten.add.Tensor), type(torch.ops.aten.add))  # an overload and its packet
_MISSING = object()


class LocalTokensMode(TorchFunctionMode):
    """Follows this rank's tokens from the last block through the training step (module docstring)."""

    def __init__(self, split: SequenceSplit, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.split, self.group = split, group
        self.active = False
        self._tracked: dict[int, tuple[weakref.ref, TokenLayout]] = {}
        self._whole: dict[tuple[int, bool], torch.Tensor] = {}  # (id, grad mode) -> the tensor gathered whole
        self.local_losses = 0
        """Losses computed on this rank's tokens (since setup)."""
        self.gathered: set[str] = set()
        """Functions that received the whole sequence gathered (since setup)."""
        self._told: set[str] = set()

    def __enter__(self) -> LocalTokensMode:
        self.start_step()
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        self.start_step()
        super().__exit__(*exc)

    def start_step(self) -> None:
        self._tracked.clear()
        self._whole.clear()

    def track_exit(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output (``(batch, length / C, ...)``), to follow."""
        layout = TokenLayout(self.split, self.group, hidden.shape[0], hidden.shape[1] * self.split.degree)
        return self._track(hidden, layout)

    def _track(self, tensor: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        key = id(tensor)
        self._tracked[key] = (weakref.ref(tensor, lambda _: self._forget(key)), layout)
        self._drop_whole(key)
        if isinstance(tensor, DTensor):  # the head's redistribution makes a new DTensor around the same local
            self._track(tensor._local_tensor, layout)
        return tensor

    def _forget(self, key: int) -> None:
        self._tracked.pop(key, None)
        self._drop_whole(key)

    def _drop_whole(self, key: int) -> None:
        for grad in (False, True):
            self._whole.pop((key, grad), None)

    def layout_of(self, value: Any) -> TokenLayout | None:
        """The layout of a followed tensor (a DTensor made from one too); None for any other value."""
        if not isinstance(value, torch.Tensor):
            return None
        layout = self._followed(value)
        if layout is None and isinstance(value, DTensor):  # DTensor.from_local of a followed tensor
            layout = self._followed(value._local_tensor)
        return layout

    def _followed(self, tensor: torch.Tensor) -> TokenLayout | None:
        entry = self._tracked.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._tracked or isinstance(func, _ATEN_OPERATORS):
            # aten operators called from Python (a dispatch mode's, autograd's backward under one) work on the
            # tensors as they are held: this rank's tokens, as the graph recorded them
            return func(*args, **kwargs)
        values = list(flat_arguments(args, kwargs))
        layouts = {layout for layout in map(self.layout_of, values) if layout is not None}
        if not layouts:
            return func(*args, **kwargs)
        name = function_name(func)
        if len(layouts) == 1:
            layout = next(iter(layouts))
            if func in _LOSSES:
                loss = self._loss(func, layout, args, kwargs)
                if loss is not None:
                    return loss
            else:
                out = self._keep_split(func, name, layout, args, kwargs)
                if out is not _MISSING:
                    return out
        if in_place(name) and args and self.layout_of(args[0]) is not None:
            raise ValueError(
                f"context_parallel: the training step changes, in place with `{name}`, a tensor computed after the"
                " last block, which holds this rank's tokens only, at positions that mix tokens (or with an"
                " operand of the whole sequence). Write it out of place (`x = x.masked_fill(...)`,"
                " `x = torch.where(...)`); writes that keep each token to itself (`logits[..., 0] = -1e4`) run as"
                " they are."
            )
        self._tell(name)
        return func(*tree_map(self._gathered, args), **tree_map(self._gathered, kwargs))

    def whole_values(self, value: Any) -> Any:
        """``value`` with every followed tensor in it gathered whole (what a step returns)."""
        return tree_map(self._gathered, value)

    def _gathered(self, value: Any) -> Any:
        """``value`` whole if followed, gathered once per tensor and grad mode (a copy made under ``no_grad`` has no
        graph); a DTensor made from a followed tensor is gathered each time (its own id is not followed)."""
        layout = self.layout_of(value)
        if layout is None:
            return value
        if self._followed(value) is None:
            return layout.whole(value)
        key = (id(value), torch.is_grad_enabled())
        if key not in self._whole:
            self._whole[key] = layout.whole(value)
        return self._whole[key]

    def _keep_split(self, func: Any, name: str, layout: TokenLayout, args: tuple, kwargs: dict) -> Any:
        """The function's answer on this rank's tokens, followed; ``_MISSING`` where it mixes tokens."""
        first = args[0] if args else None
        # Sizes answer for the whole sequence, as one process's; where grad is off (inside a custom autograd
        # Function's forward, whose kernels read this storage, or under no_grad) they are this rank's, as held.
        sizes_whole = torch.is_grad_enabled()
        if name == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "shape" and sizes_whole:
                return layout.whole_shape(first)
            return func(*args, **kwargs) if prop in PROPERTIES | {"shape"} else _MISSING
        if self.layout_of(first) is not None and name in ("size", "numel", "nelement", "__len__"):
            if not sizes_whole:
                return func(*args, **kwargs)
            whole = layout.whole_shape(first)
            if name == "__len__":
                return whole[0]
            if name in ("numel", "nelement"):
                return math.prod(whole)
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return whole if dim is None else whole[dim]
        if self.layout_of(first) is not None and name in PASS_THROUGH:
            return func(*args, **kwargs)
        call = per_token_call(func, name, layout, args, kwargs, self.layout_of)
        if call is None:
            return _MISSING
        out_layout, run = call
        out = run()
        # the followed tensor changed, and views of it: whole copies made before are out of date
        if in_place(name):
            self._whole.clear()
        return self._follow(out, out_layout)

    def _follow(self, out: Any, layout: TokenLayout) -> Any:
        def follow(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if value.dim() < layout.token_dims or not layout.holds(value):
                raise RuntimeError(
                    f"lightning_parallel (context parallelism): a function judged per-token returned a tensor of"
                    f" shape {tuple(value.shape)}, not led by this rank's tokens {layout.local_leading()}. Please"
                    " report this with the training step's code."
                )
            return self._track(value, layout)

        if isinstance(out, tuple) and hasattr(out, "_fields"):  # max/min with a dim: (values, indices)
            return type(out)(*(follow(v) for v in out))
        return tree_map(follow, out)

    def _loss(self, func: Any, layout: TokenLayout, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The loss of this rank's tokens, gathered per token and reduced as asked (None: not applicable)."""
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        logits, target, reduction = given["input"], given["target"], given["reduction"]
        usable = (
            self.layout_of(logits) == layout
            and layout.flat
            and logits.dim() == 2
            and isinstance(target, torch.Tensor)
            and self.layout_of(target) is None
            and not target.is_floating_point()
            and target.numel() == layout.batch * layout.length
            and given.get("weight") is None
            and given.get("size_average") is None
            and given.get("reduce") is None
            and reduction in ("mean", "sum", "none")
        )
        if not usable:
            return None
        local = dict(given, target=layout.local_targets(target), reduction="none")
        per_token = func(**local)
        self.local_losses += 1
        whole = layout.whole(per_token.reshape(layout.batch * layout.local_length))
        if reduction == "none":
            return whole
        if reduction == "sum":
            return whole.sum()
        return whole.sum() / (target != given["ignore_index"]).sum()

    def _tell(self, name: str) -> None:
        self.gathered.add(name)
        if name not in self._told:
            self._told.add(name)
            rank_zero_info(
                f"context_parallel: the training step passed the hidden state after the last block (or what was"
                f" computed from it) to `{name}`, which receives it gathered over the whole sequence on every"
                " context rank; the head and the loss otherwise run on each rank's tokens."
            )
