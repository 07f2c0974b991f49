"""After the last block, the final norm, the head and the loss run on this rank's tokens only.

Leaving the block stack, the split could gather the whole sequence on every context rank (as it does
outside training steps): model-level code after the stack then sees what one process sees, but every
rank computes the final norm, the head and the loss for the whole sequence, and keeps their
activations for backward. At long context with a large vocabulary that is most of a rank's activations
(the loss's fp32 log-probabilities: ``sequence x vocabulary`` per sequence). Megatron and torchtitan
compute the head and the loss on each rank's tokens, with the labels split like the inputs; their
training loops split both. The user's training step here is unchanged, so the split follows the
hidden state instead (:class:`LocalTokensMode`, a ``TorchFunctionMode`` around the training step):

- functions that work on each token alone keep the tensor split: casts, elementwise arithmetic with
  operands that broadcast over features only, ``F.linear`` and matmuls by a weight, norms, softmaxes
  and reductions over features, and reshapes that merge or split batch and sequence;
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch._ops import OpOverload, OpOverloadPacket
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import tree_map
from lightning_parallel.context_parallel.split import SequenceSplit, gather

__all__ = ["LocalTokensMode", "TokenLayout"]

_CASTS = {"float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "detach", "clone"}
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid",
    "abs", "clamp", "clip", "maximum", "minimum", "where", "masked_fill", "square", "reciprocal", "erf",
    "relu", "gelu", "silu", "softplus", "elu", "leaky_relu", "mish", "hardtanh", "eq", "ne", "lt", "le", "gt",
    "ge", "logical_not", "isnan", "isinf", "isfinite", "nan_to_num", "softcap",
}  # fmt: skip
_FEATURE_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "norm",
                       "var", "std", "prod", "softmax", "log_softmax", "cumsum", "all", "any"}  # fmt: skip
_PASS_THROUGH = {
    "dim", "ndimension", "stride", "is_contiguous", "element_size", "is_floating_point", "is_complex",
    "get_device", "data_ptr", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "retain_grad", "untyped_storage", "storage_offset",
}  # fmt: skip
_PROPERTIES = {"dtype", "device", "requires_grad", "grad_fn", "is_leaf", "layout", "is_cuda", "is_cpu", "ndim",
               "grad", "is_meta", "names", "output_nr", "_version", "_base", "is_sparse", "is_quantized"}  # fmt: skip
_ELEMENTWISE_NAMES = {"__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                      "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__iadd__", "__isub__", "__imul__",
                      "__itruediv__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"}  # fmt: skip
_LOSSES = (F.cross_entropy, F.nll_loss)
_MISSING = object()


@dataclass(frozen=True)
class TokenLayout:
    """How a tensor holding this rank's tokens stands for the whole one: its leading dimensions are
    ``(batch, length / C)`` (``flat``: their product) of a ``(batch, length)`` sequence batch."""

    split: SequenceSplit
    group: dist.ProcessGroup
    batch: int
    length: int
    flat: bool = False

    @property
    def token_dims(self) -> int:
        return 1 if self.flat else 2

    @property
    def local_length(self) -> int:
        return self.length // self.split.degree

    def local_leading(self) -> tuple[int, ...]:
        return (self.batch * self.local_length,) if self.flat else (self.batch, self.local_length)

    def whole_leading(self) -> tuple[int, ...]:
        return (self.batch * self.length,) if self.flat else (self.batch, self.length)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (local) has this layout's leading dimensions."""
        return tuple(tensor.shape[: self.token_dims]) == self.local_leading()

    def whole_shape(self, tensor: torch.Tensor) -> torch.Size:
        return torch.Size((*self.whole_leading(), *tensor.shape[self.token_dims :]))

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tokens in sequence order (the split's gather, with its gradient rule)."""
        if isinstance(tensor, DTensor):  # logits also sharded over the vocabulary: whole over tp first
            tensor = tensor.redistribute(placements=[Replicate()] * tensor.device_mesh.ndim).to_local()
        features = tuple(tensor.shape[self.token_dims :])
        shaped = tensor.reshape(self.batch, self.local_length, *features) if self.flat else tensor
        whole = gather(shaped, self.split, self.group, dim=1)
        return whole.reshape(self.batch * self.length, *features) if self.flat else whole

    def local_targets(self, target: torch.Tensor) -> torch.Tensor:
        """This rank's entries of a flattened ``(batch x length)`` target, in the order its tokens are held."""
        positions = self.split.positions(self.length, target.device)
        return target.reshape(self.batch, self.length).index_select(1, positions).reshape(-1)


class LocalTokensMode(TorchFunctionMode):
    """Follows this rank's tokens from the last block through the training step (module docstring)."""

    def __init__(self, split: SequenceSplit, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.split, self.group = split, group
        self.active = False
        self._tracked: dict[int, tuple[weakref.ref, TokenLayout]] = {}
        self._whole: dict[int, torch.Tensor] = {}
        self._whole_only: set[int] = set()
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
        self._whole_only.clear()

    def track_exit(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last block's output (``(batch, length / C, ...)``), to follow."""
        layout = TokenLayout(self.split, self.group, hidden.shape[0], hidden.shape[1] * self.split.degree)
        return self._track(hidden, layout)

    def _track(self, tensor: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        key = id(tensor)
        self._tracked[key] = (weakref.ref(tensor, lambda _: self._forget(key)), layout)
        self._whole.pop(key, None)
        if isinstance(tensor, DTensor):  # the head's redistribution makes a new DTensor around the same local
            self._track(tensor._local_tensor, layout)
        return tensor

    def _forget(self, key: int) -> None:
        self._tracked.pop(key, None)
        self._whole.pop(key, None)
        self._whole_only.discard(key)

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
        if not self._tracked or isinstance(func, (OpOverload, OpOverloadPacket)):
            # aten operators called from Python (a dispatch mode's, autograd's backward under one) work on the
            # tensors as they are held: this rank's tokens, as the graph recorded them
            return func(*args, **kwargs)
        values = list(_flat(args, kwargs))
        layouts = {layout for layout in map(self.layout_of, values) if layout is not None}
        if not layouts:
            return func(*args, **kwargs)
        name = _name(func)
        stale = any(id(v) in self._whole_only for v in values)
        if len(layouts) == 1 and not stale:
            layout = next(iter(layouts))
            if func in _LOSSES:
                loss = self._loss(func, layout, args, kwargs)
                if loss is not None:
                    return loss
            else:
                out = self._keep_split(func, name, layout, args, kwargs)
                if out is not _MISSING:
                    return out
        self._tell(name)
        out = func(*tree_map(self._gathered, args), **tree_map(self._gathered, kwargs))
        if _in_place(name) and args and self.layout_of(args[0]) is not None:
            # the whole copy changed, not this rank's tokens: from now on every use takes the copy
            self._whole[id(args[0])] = out
            self._whole_only.add(id(args[0]))
        return out

    def whole_values(self, value: Any) -> Any:
        """``value`` with every followed tensor in it gathered whole (what a step returns)."""
        return tree_map(self._gathered, value)

    def _gathered(self, value: Any) -> Any:
        layout = self.layout_of(value)
        if layout is None:
            return value
        key = id(value)
        if key not in self._whole:
            self._whole[key] = layout.whole(value)
        return self._whole[key]

    def _keep_split(self, func: Any, name: str, layout: TokenLayout, args: tuple, kwargs: dict) -> Any:
        """The function's answer on this rank's tokens, followed; ``_MISSING`` where it mixes tokens."""
        first = args[0] if args else None
        if name == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "shape":
                return layout.whole_shape(first)
            return func(*args, **kwargs) if prop in _PROPERTIES else _MISSING
        anchor = next(v for v in _flat(args, kwargs) if self.layout_of(v) is not None)
        if name in _ELEMENTWISE_NAMES or _base(name) in _ELEMENTWISE:
            return self._elementwise(func, layout, anchor, args, kwargs)
        if self.layout_of(first) is None:
            return _MISSING
        if name in ("size", "numel", "nelement", "__len__"):
            whole = layout.whole_shape(first)
            if name == "__len__":
                return whole[0]
            if name in ("numel", "nelement"):
                return math.prod(whole)
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return whole if dim is None else whole[dim]
        if name in _PASS_THROUGH:
            return func(*args, **kwargs)
        local_call = self._local_call(func, _base(name), layout, first, args, kwargs)
        if local_call is None:
            return _MISSING
        out_layout, call = local_call
        out = call()
        if _in_place(name):  # the followed tensor changed: a whole copy made before is out of date
            self._whole.pop(id(first), None)
        return self._follow(out, out_layout)

    def _elementwise(
        self, func: Any, layout: TokenLayout, anchor: torch.Tensor, args: tuple, kwargs: dict
    ) -> Any:
        """Arithmetic where every operand meets each token alone (``weight * hidden``, ``logits / cap``)."""
        features = anchor.dim() - layout.token_dims
        if not all(self._broadcasts_per_token(v, layout, features) for v in _flat(args, kwargs)):
            return _MISSING
        out = func(*args, **kwargs)
        if _in_place(_name(func)) and args:
            self._whole.pop(id(args[0]), None)
        return self._follow(out, layout)

    def _local_call(
        self, func: Any, base: str, layout: TokenLayout, first: torch.Tensor, args: tuple, kwargs: dict
    ) -> tuple[TokenLayout, Callable[[], Any]] | None:
        """How to run ``func`` on this rank's tokens, and the layout of its result (None: it mixes tokens)."""
        features = first.dim() - layout.token_dims
        if base in _CASTS:
            return (layout, lambda: func(*args, **kwargs)) if _same_device(first, args, kwargs) else None
        if base == "dropout" and _dropout_is_identity(args, kwargs):
            return layout, lambda: func(*args, **kwargs)
        if base in ("linear", "layer_norm", "rms_norm"):
            others = _flat(args[1:], kwargs)
            if all(self.layout_of(v) is None for v in others) and _norm_fits(base, args, kwargs, features):
                return layout, lambda: func(*args, **kwargs)
            return None
        if base == "matmul":
            other = args[1] if len(args) > 1 else None
            if isinstance(other, torch.Tensor) and self.layout_of(other) is None and other.dim() in (1, 2):
                return layout, lambda: func(*args, **kwargs)
            return None
        if base in _FEATURE_REDUCTIONS:
            dims = _dims_argument(base, args, kwargs)
            if dims and all((d % first.dim()) >= layout.token_dims for d in dims):
                return layout, lambda: func(*args, **kwargs)
            return None
        if base in ("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"):
            requested = _requested_shape(base, layout.whole_shape(first), args, kwargs, self)
            return None if requested is None else _reshaped(layout, first, requested)
        if base == "getitem":
            return (
                (layout, lambda: func(*args, **kwargs))
                if _keeps_tokens(args[1], first.dim(), layout)
                else None
            )
        return None

    def _broadcasts_per_token(self, value: Any, layout: TokenLayout, features: int) -> bool:
        """An operand that meets each token alone: a number, the same layout, or a tensor over features only."""
        other = self.layout_of(value)
        if other is not None:
            return other == layout and layout.holds(value)
        return not isinstance(value, torch.Tensor) or value.dim() <= features

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


def _reshaped(
    layout: TokenLayout, first: torch.Tensor, requested: tuple[int, ...]
) -> tuple[TokenLayout, Callable[[], Any]] | None:
    """A reshape of the whole tensor that keeps tokens together, as the same reshape of this rank's tokens."""
    tokens = layout.batch * layout.length
    if requested and requested[0] == tokens:
        target, local = replace(layout, flat=True), (layout.batch * layout.local_length, *requested[1:])
    elif len(requested) >= 2 and requested[:2] == (layout.batch, layout.length):
        target, local = replace(layout, flat=False), (layout.batch, layout.local_length, *requested[2:])
    else:
        return None
    return target, lambda: first.reshape(local)


def _requested_shape(
    base: str, whole: torch.Size, args: tuple, kwargs: dict, mode: LocalTokensMode
) -> tuple[int, ...] | None:
    """The shape a reshape asks of the whole tensor (-1 resolved), or None where it is not a plain shape."""
    if base in ("view_as", "reshape_as"):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if not isinstance(other, torch.Tensor):
            return None
        other_layout = mode.layout_of(other)
        shape = tuple(other_layout.whole_shape(other) if other_layout is not None else other.shape)
    elif base == "flatten":
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        start, end = start % len(whole), end % len(whole)
        shape = (*whole[:start], math.prod(whole[start : end + 1]), *whole[end + 1 :])
    elif base == "unflatten":
        dim = (args[1] if len(args) > 1 else kwargs["dim"]) % len(whole)
        sizes = tuple(args[2] if len(args) > 2 else kwargs["sizes"])
        shape = (*whole[:dim], *sizes, *whole[dim + 1 :])
    else:
        rest = args[1:] if len(args) > 1 else (kwargs.get("shape", kwargs.get("size", ())),)
        shape = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
        if not all(isinstance(s, int) for s in shape):
            return None  # view(dtype)
    if sum(1 for s in shape if s == -1) > 1:
        return None
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or math.prod(whole) % known:
            return None
        shape = tuple(math.prod(whole) // known if s == -1 else s for s in shape)
    return shape if math.prod(shape) == math.prod(whole) else None


def _keeps_tokens(key: Any, ndim: int, layout: TokenLayout) -> bool:
    """Indexing with integers and slices that leaves every token dimension whole (``x[..., :V]``, ``x[:, 0:]``)."""
    key = key if isinstance(key, tuple) else (key,)
    if (
        not all(isinstance(k, (int, slice)) or k is Ellipsis for k in key)
        or sum(k is Ellipsis for k in key) > 1
    ):
        return False
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = (*key[:at], *[slice(None)] * (ndim - len(key) + 1), *key[at + 1 :])
    key = (*key, *[slice(None)] * (ndim - len(key)))
    return all(
        isinstance(k, slice) and k.start in (None, 0) and k.stop is None and k.step in (None, 1)
        for k in key[: layout.token_dims]
    )


def _dims_argument(base: str, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The ``dim`` a reduction was given (empty: none, it reduces over everything)."""
    at = 2 if base == "norm" else 1  # Tensor.norm(p, dim)
    dim = kwargs.get("dim", args[at] if len(args) > at else None)
    if (
        isinstance(dim, (tuple, list))
        and dim
        and all(isinstance(d, int) and not isinstance(d, bool) for d in dim)
    ):
        return tuple(dim)
    if isinstance(dim, int) and not isinstance(dim, bool):
        return (dim,)
    return ()


def _norm_fits(base: str, args: tuple, kwargs: dict, features: int) -> bool:
    """A norm over the trailing features only (``linear`` always is per token)."""
    if base == "linear":
        return True
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    shape = (shape,) if isinstance(shape, int) else tuple(shape or ())
    return 0 < len(shape) <= features


def _dropout_is_identity(args: tuple, kwargs: dict) -> bool:
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return p == 0 or not training


def _same_device(first: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether a cast keeps the tensor where it is (a move to another device gathers first, on this one)."""
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, torch.Tensor):
            device = value.device
        elif isinstance(value, torch.device):
            device = value
        elif isinstance(value, str):
            try:
                device = torch.device(value)
            except RuntimeError:
                continue
        else:
            continue
        here = first.device
        if device.type != here.type or (device.index is not None and device.index != here.index):
            return False
    return True


def _base(name: str) -> str:
    """``__radd__``, ``add_``, ``__iadd__`` -> ``add``: the operation whatever its operand order or place."""
    base = name.strip("_")
    base = base[1:] if base[:1] in ("r", "i") and base[1:] in _ELEMENTWISE | {"truediv"} else base
    return {"truediv": "div"}.get(base, base)


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or (
        name.startswith("__i") and name != "__index__"
    )


def _name(func: Any) -> str:
    return getattr(func, "__name__", repr(func))


def _flat(args: tuple, kwargs: dict) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value
