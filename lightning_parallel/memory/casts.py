"""16-bit casts that autograd would keep for backward, kept once or not at all (saved-tensor hooks).

Under ``*-mixed`` precision autocast casts each matmul's fp32 operands to 16 bits, and the matmul
saves the 16-bit copies for its backward. Two kinds of those copies are redundant:

- **weights** (:class:`WeightCastReference`): every use of a weight, in every micro-batch, saved its own
  16-bit copy of the whole weight (Lightning enters autocast with its weight cache off, so each matmul
  casts afresh), and a pipeline stage with k micro-batches in flight held k copies of its weights
  (GPT-175B under 1F1B on 8 stages: 42 GiB of its first stage). Here the saved copy becomes a reference
  to its fp32 parameter, cast again when backward reads it: no 16-bit weight outlives the op that uses
  it, whatever the schedule, recomputation or ZeRO-3 gather (a parameter is gathered again before its
  backward, as for any saved weight). Megatron keeps one 16-bit copy of the weights; this keeps none.
- **activations cast by several projections**: q, k and v (gate and up) each cast the same fp32 input
  and each saved its copy; the copies are equal, so the first is kept and the others are views of it.

Why not autocast's own cache (``cache_enabled=True``): it shares one cast *node* between every use, so
the gradients of all uses are summed in 16 bits before the cast back to fp32, and torch's zero-bubble
schedules split backward at such shared nodes. Here the forward and the autograd graph stay exactly
autocast's (one cast and one ``ToCopyBackward0`` per use, each weight's gradient accumulated in fp32 by
its ``AccumulateGrad``), and a cast is deterministic, so every gradient is bitwise what it was
(``tests/memory/test_casts.py``). The price: one more cast of each weight per use in backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel.memory.counting import StorageSet, local_tensor

__all__ = ["CastSaver", "CastStats", "WeightCastReference", "cast_parameter", "cast_source"]

# Autograd nodes of views that share their input's storage (a linear saves its weight's cast transposed,
# its input's cast reshaped).
VIEW_NODES = {
    "TBackward0",
    "TransposeBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "AliasBackward0",
}


def cast_source(tensor: torch.Tensor) -> tuple[Any, int] | None:
    """The autograd edge a saved tensor was cast from (``(node, output_nr)``, through views of the cast), or
    None when it is no cast (or a cast of a tensor that needs no gradient: nothing identifies its source)."""
    fn = tensor.grad_fn
    for _ in range(4):
        if fn is None or type(fn).__name__ not in VIEW_NODES or not fn.next_functions:
            break
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return None
    node, output_nr = fn.next_functions[0]
    return (node, output_nr) if node is not None else None


def cast_parameter(tensor: torch.Tensor) -> nn.Parameter | None:
    """The parameter a saved tensor is a cast (or a view of a cast) of, if it is one."""
    source = cast_source(tensor)
    variable = getattr(source[0], "variable", None) if source is not None else None
    return variable if isinstance(variable, nn.Parameter) else None


class _Geometry:
    """Where a saved tensor lies in its storage, and its DTensor layout: rebuilt on another equal storage."""

    __slots__ = ("offset", "shape", "stride", "spec")

    def __init__(self, tensor: torch.Tensor) -> None:
        local = local_tensor(tensor)
        self.offset, self.shape, self.stride = local.storage_offset(), tuple(local.shape), local.stride()
        self.spec = (
            (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            if isinstance(tensor, DTensor)
            else None
        )

    def on(self, base: torch.Tensor) -> torch.Tensor:
        """The saved tensor, as a view of ``base`` (a local tensor holding the same values in the same layout)."""
        local = base.as_strided(self.shape, self.stride, self.offset)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class WeightCastReference:
    """A saved 16-bit copy of a weight, kept as its fp32 parameter: cast again when backward reads it."""

    __slots__ = ("parameter", "dtype", "version", "geometry", "__weakref__")

    def __init__(self, tensor: torch.Tensor, parameter: nn.Parameter) -> None:
        self.parameter, self.dtype, self.version = parameter, tensor.dtype, parameter._version
        self.geometry = _Geometry(tensor)

    def restore(self) -> torch.Tensor:
        parameter = self.parameter
        if parameter._version != self.version:
            raise RuntimeError(
                f"A weight of shape {tuple(parameter.shape)} was modified in place between its use in forward and"
                " its backward; its 16-bit copy was not kept (lightning_parallel.memory.casts), so the gradient"
                " would use the new values. Modify weights outside the training step (or in optimizer hooks)."
            )
        local = local_tensor(parameter).detach()
        if local.untyped_storage().nbytes() == 0:
            raise RuntimeError(
                f"A weight of shape {tuple(parameter.shape)} holds no data at its backward (a ZeRO-3 shard not"
                " gathered again?); its 16-bit copy was not kept (lightning_parallel.memory.casts)."
            )
        return self.geometry.on(local.to(self.dtype))  # autocast's cast: the same values, the same layout


@dataclass
class CastStats:
    """What a step did not keep: weight casts referenced, activation casts shared (counts and bytes)."""

    weight_casts: int = 0
    weight_bytes: int = 0
    shared_casts: int = 0
    shared_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class CastSaver:
    """The part of the saved-tensor hooks that handles casts; the rest (counting, offload) is the caller's.

    ``weights``: keep saved weight casts as references (:class:`WeightCastReference`); ``activations``:
    keep one copy of an activation's cast for all its readers. Both on by default; off, a saved cast is
    left to the caller as before (the negative controls of the tests).
    """

    weights: bool = True
    activations: bool = True
    stats: CastStats = field(default_factory=CastStats)
    # (source node id, output_nr, dtype) -> (weak reference to the first copy's storage, the source node)
    _copies: dict[tuple[int, int, torch.dtype], tuple[weakref.ref, Any]] = field(default_factory=dict)
    _seen_weights: StorageSet = field(default_factory=StorageSet)

    def reset(self) -> None:
        """A new step: fresh statistics (the copies of the last step are gone with its graph)."""
        self.stats = CastStats()
        self._copies.clear()
        self._seen_weights.clear()

    def pack(self, tensor: torch.Tensor) -> WeightCastReference | torch.Tensor:
        """What to keep instead of ``tensor``: a reference to its weight, a view of an equal copy already
        kept, or ``tensor`` itself (no cast this saver handles: the caller saves it as it would have)."""
        if not (self.weights or self.activations) or not tensor.is_floating_point():
            return tensor
        source = cast_source(tensor)
        if source is None:
            return tensor
        variable = getattr(source[0], "variable", None)
        if isinstance(variable, nn.Parameter):
            # DeepSpeed's ZeRO-3 partitions its own weights
            if not self.weights or hasattr(variable, "ds_id"):
                return tensor
            self._count_weight(tensor)
            return WeightCastReference(tensor, variable)
        return self._shared(tensor, source) if self.activations else tensor

    def _count_weight(self, tensor: torch.Tensor) -> None:
        self.stats.weight_casts += 1
        if tensor not in self._seen_weights:  # one copy saved by two ops (a tied weight) counts once
            self._seen_weights.add(tensor)
            self.stats.weight_bytes += local_tensor(tensor).untyped_storage().nbytes()

    def _shared(self, tensor: torch.Tensor, source: tuple[Any, int]) -> torch.Tensor:
        local = local_tensor(tensor)
        storage = local.untyped_storage()
        key = (id(source[0]), source[1], tensor.dtype)
        held = self._copies.get(key)
        first = held[0]() if held is not None else None
        if first is None or first.nbytes() != storage.nbytes():
            # The first copy of this source: kept as autograd would keep it; later equal copies view it.
            ref = weakref.ref(storage)
            self._copies[key] = (ref, source[0])  # the node held: its id stays unique while the entry lives
            weakref.finalize(storage, self._forget, key, ref)
            return tensor
        if first.data_ptr() == storage.data_ptr():
            return tensor
        self.stats.shared_casts += 1
        self.stats.shared_bytes += storage.nbytes()
        with torch.no_grad():
            base = torch.empty(0, dtype=local.dtype, device=local.device).set_(first)
            return _Geometry(tensor).on(base)  # holds the first copy's storage, not this one's

    def _forget(self, key: tuple[int, int, torch.dtype], ref: weakref.ref) -> None:
        held = self._copies.get(key)
        if held is not None and held[0] is ref:
            del self._copies[key]
