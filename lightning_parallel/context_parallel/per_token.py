"""Which functions work on each token alone, and how a tensor of this rank's tokens stands for the whole one.

The rules :class:`~lightning_parallel.context_parallel.local_tokens.LocalTokensMode` follows a tensor by
(``local_tokens.py`` says why): a function runs on this rank's tokens only where each token's result depends
on that token alone, judged from the function and its arguments, never from values:

- casts on the same device (a move to another device gathers first, on this one);
- elementwise arithmetic whose other operands are numbers, tensors of the same layout, or tensors over the
  trailing feature dimensions only (a norm's weight, a soft cap);
- ``F.linear``, matmuls by a weight, ``F.layer_norm``/``F.rms_norm`` over trailing features, dropout that is
  the identity;
- reductions, softmaxes and cumulative sums over feature dimensions (a ``dim`` given, none of them a token
  dimension);
- reshapes of the whole tensor that merge batch and sequence or split them back (``view(B * T, V)``,
  ``view(-1, V)``, ``flatten(0, 1)``), and indexing that leaves every token dimension whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.context_parallel.split import SequenceSplit, gather
from lightning_parallel.tensor_parallel.regions import basic_index, flat_arguments

__all__ = [
    "PASS_THROUGH",
    "PROPERTIES",
    "LayoutOf",
    "TokenLayout",
    "function_name",
    "in_place",
    "per_token_call",
]

_CASTS = {"float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "detach", "clone"}
_ELEMENTWISE = set(
    "add sub mul div true_divide pow neg exp log sqrt rsqrt tanh sigmoid abs clamp clip maximum minimum where"
    " masked_fill square reciprocal erf relu gelu silu softplus elu leaky_relu mish hardtanh eq ne lt le gt ge"
    " logical_not isnan isinf isfinite nan_to_num softcap".split()
)
_FEATURE_REDUCTIONS = set(
    "sum mean amax amin max min argmax argmin logsumexp norm var std prod softmax log_softmax cumsum all any".split()
)
PASS_THROUGH = set(
    "dim ndimension stride is_contiguous element_size is_floating_point is_complex get_device data_ptr"
    " register_hook register_post_accumulate_grad_hook requires_grad_ retain_grad untyped_storage"
    " storage_offset".split()
)
PROPERTIES = set(
    "dtype device requires_grad grad_fn is_leaf layout is_cuda is_cpu ndim grad is_meta names output_nr"
    " _version _base is_sparse is_quantized".split()
)
_ELEMENTWISE_NAMES = set(
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ __rpow__ __neg__"
    " __iadd__ __isub__ __imul__ __itruediv__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__".split()
)


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


LayoutOf = Callable[[Any], "TokenLayout | None"]


def per_token_call(
    func: Any, name: str, layout: TokenLayout, args: tuple, kwargs: dict, layout_of: LayoutOf
) -> tuple[TokenLayout, Callable[[], Any]] | None:
    """How to run ``func`` on this rank's tokens, and the layout of its result (None: it mixes tokens).

    ``layout_of``: the layout of each followed tensor (None for any other value)."""
    base = _base(name)
    if base == "where" and len(args) + len(kwargs) < 3:
        return None  # torch.where(condition): the indices of its true entries
    if base == "setitem":
        return _per_token_setitem(func, layout, args, layout_of)
    if name in _ELEMENTWISE_NAMES or base in _ELEMENTWISE:
        anchor = next(v for v in flat_arguments(args, kwargs) if layout_of(v) is not None)
        features = anchor.dim() - layout.token_dims
        if all(_broadcasts_per_token(v, layout, features, layout_of) for v in flat_arguments(args, kwargs)):
            return layout, lambda: func(*args, **kwargs)
        return None
    first = args[0] if args else None
    if layout_of(first) is None:
        return None
    features = first.dim() - layout.token_dims
    if base in _CASTS:
        return (layout, lambda: func(*args, **kwargs)) if _same_device(first, args, kwargs) else None
    if base == "dropout" and _dropout_is_identity(args, kwargs):
        return layout, lambda: func(*args, **kwargs)
    if base in ("linear", "layer_norm", "rms_norm"):
        others = flat_arguments(args[1:], kwargs)
        if all(layout_of(v) is None for v in others) and _norm_fits(base, args, kwargs, features):
            return layout, lambda: func(*args, **kwargs)
        return None
    if base == "matmul":
        other = args[1] if len(args) > 1 else None
        if isinstance(other, torch.Tensor) and layout_of(other) is None and other.dim() in (1, 2):
            return layout, lambda: func(*args, **kwargs)
        return None
    if base in _FEATURE_REDUCTIONS:
        dims = _dims_argument(base, args, kwargs)
        if dims and all((d % first.dim()) >= layout.token_dims for d in dims):
            return layout, lambda: func(*args, **kwargs)
        return None
    if base in ("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"):
        requested = _requested_shape(base, layout.whole_shape(first), args, kwargs, layout_of)
        return None if requested is None else _reshaped(layout, first, requested)
    if base == "getitem":
        return (
            (layout, lambda: func(*args, **kwargs)) if _keeps_tokens(args[1], first.dim(), layout) else None
        )
    return None


def _per_token_setitem(
    func: Any, layout: TokenLayout, args: tuple, layout_of: LayoutOf
) -> tuple[TokenLayout, Callable[[], Any]] | None:
    """``x[..., 0] = v``: a write that leaves every token dimension whole, of a number or of a value over features."""
    if len(args) != 3 or layout_of(args[0]) is None or not _keeps_tokens(args[1], args[0].dim(), layout):
        return None
    value = args[2]
    if isinstance(value, torch.Tensor) and (layout_of(value) is not None or value.dim() > 0):
        return None
    return layout, lambda: func(*args)


def _broadcasts_per_token(value: Any, layout: TokenLayout, features: int, layout_of: LayoutOf) -> bool:
    """An operand that meets each token alone: a number, the same layout, or a tensor over features only."""
    other = layout_of(value)
    if other is not None:
        return other == layout and layout.holds(value)
    return not isinstance(value, torch.Tensor) or value.dim() <= features


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
    base: str, whole: torch.Size, args: tuple, kwargs: dict, layout_of: LayoutOf
) -> tuple[int, ...] | None:
    """The shape a reshape asks of the whole tensor (-1 resolved), or None where it is not a plain shape."""
    if base in ("view_as", "reshape_as"):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if not isinstance(other, torch.Tensor):
            return None
        other_layout = layout_of(other)
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
    expanded = basic_index(key, ndim)
    return expanded is not None and all(
        isinstance(k, slice) and k.start in (None, 0) and k.stop is None and k.step in (None, 1)
        for k in expanded[: layout.token_dims]
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


_IN_PLACE_OPERATORS = set(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __iand__ __ior__"
    " __ixor__ __ilshift__ __irshift__ __imatmul__".split()
)


def in_place(name: str) -> bool:
    """``add_``, ``__iadd__``, ``__setitem__``: the function changes its first argument."""
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__"))


def function_name(func: Any) -> str:
    return getattr(func, "__name__", repr(func))
