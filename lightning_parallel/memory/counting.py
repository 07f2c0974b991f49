"""Exact accounting of the activation memory a training step holds for its backward pass.

Autograd keeps, from the forward to the backward, every tensor an op saved for its gradient.
:class:`SavedTensorCounter` sees each of them through ``torch.autograd.graph.saved_tensors_hooks``
(the same hooks the offload and compression savers use) and adds up *distinct storages*: the
``q``, ``k`` and ``v`` views of one fused projection hold one buffer, and a tensor saved by two
ops is held once. Parameters (weights saved by matmuls) are not activations and are skipped.

Activation checkpointing saves the positional inputs of a recomputed region as ordinary saved
tensors (so they are counted, offloaded and compressed like the others), but also holds
tensors outside autograd's saved tensors: keyword-argument inputs (kept by the recomputation
closure) and, for selective checkpointing, the outputs of the ops it keeps. The checkpoint
wrappers report those here (:meth:`SavedTensorCounter.hold`), so one number covers every option.

All byte counts are per process (local shards under tensor parallelism).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from lightning_parallel.compat import is_traceable_wrapper_subclass

__all__ = [
    "ActivationBytes",
    "SavedTensorCounter",
    "StorageSet",
    "active_counter",
    "counting",
    "kept_as_is",
    "local_tensor",
    "storage_key",
]


def kept_as_is(tensor: torch.Tensor) -> torch.Tensor:
    """What a pack hook stores when it keeps a saved tensor as it is: the tensor without its autograd history.

    A tensor kept with its ``grad_fn`` makes the graph hold itself (a node that saves its own output, or one
    above it, keeps a reference to that node), a cycle through C++ that Python's collector cannot see. Autograd
    breaks it when the node runs with ``retain_graph=False``; torch's zero-bubble pipeline schedules run the
    input pass with ``retain_graph=True`` and the weight pass only below the weights, so every micro-batch's
    attention and activation-function tensors stayed alive, step after step (``tests/memory/test_saved_cycles.py``).
    ``detach`` shares the storage and the version counter: autograd's checks on unpacking still hold.
    """
    return tensor.detach() if tensor.requires_grad and tensor.grad_fn is not None else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory on this process: a DTensor's local shard, the result inside a
    functional collective's ``AsyncCollectiveTensor`` (a tensor-parallel output), which have no storage
    of their own."""
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = cast(Any, tensor).__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    local = local_tensor(tensor)
    return (str(local.device), local.untyped_storage().data_ptr())


def _storage_bytes(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage().nbytes()


class StorageSet:
    """Storages seen so far, by address, that are still alive.

    A storage freed during the forward pass (its activation was copied by a saver) can have its
    address reused by a new one; each entry keeps a weak reference to its storage, so a reused
    address counts as new. (Storages keep their Python object while the memory lives.)
    """

    def __init__(self) -> None:
        self._refs: dict[tuple[str, int], weakref.ref] = {}

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self._refs.get(storage_key(tensor))
        return ref is not None and ref() is not None

    def add(self, tensor: torch.Tensor) -> None:
        self._refs[storage_key(tensor)] = weakref.ref(local_tensor(tensor).untyped_storage())

    def clear(self) -> None:
        self._refs.clear()


@dataclass
class ActivationBytes:
    """Bytes held for the backward pass of one training step (one process).

    Attributes:
        saved: activations autograd saved outside recomputed regions (including the inputs of
            recomputed regions), as produced: distinct storages, parameters excluded.
        stored: what is actually kept for ``saved`` after compression (``saved`` without it).
        offloaded: the part of ``stored`` that lives in host memory.
        recompute_inputs: keyword-argument inputs of checkpointed regions, kept to recompute them.
        recompute_kept: outputs of the ops selective checkpointing keeps instead of recomputing.
        tensors: number of saved tensors seen (before de-duplication).
        peak: the most of ``saved`` plus the recomputation's held tensors alive at one moment of
            the step: under pipeline stages, what the schedule's in-flight micro-batches hold
            together (a storage leaves the count when autograd frees it after its backward).
        alive_after_step: what of ``peak``'s storages is still alive when the step has ended (after its
            backward and optimizer step): 0 unless something keeps the step's graph alive (a leak;
            ``ActivationMemoryMonitor`` reads it at the end of each batch).
    """

    saved: int = 0
    stored: int = 0
    offloaded: int = 0
    recompute_inputs: int = 0
    recompute_kept: int = 0
    tensors: int = 0
    peak: int = 0
    alive_after_step: int = 0

    @property
    def on_device(self) -> int:
        """Activation bytes that stay in accelerator memory until the backward pass."""
        return self.stored - self.offloaded + self.recompute_inputs + self.recompute_kept

    @property
    def total(self) -> int:
        """Activation bytes held anywhere (accelerator and host)."""
        return self.stored + self.recompute_inputs + self.recompute_kept

    def as_dict(self) -> dict[str, int]:
        return {
            "saved": self.saved,
            "stored": self.stored,
            "offloaded": self.offloaded,
            "recompute_inputs": self.recompute_inputs,
            "recompute_kept": self.recompute_kept,
            "on_device": self.on_device,
            "total": self.total,
            "tensors": self.tensors,
            "peak": self.peak,
            "alive_after_step": self.alive_after_step,
        }


@dataclass
class SavedTensorCounter:
    """Counts the activation bytes of the forward passes run while it is active.

    Use :func:`counting` (or a saver's context, which consults :func:`active_counter`).
    ``parameters`` are recognised by storage and never counted as activations.
    """

    parameters: Iterable[torch.Tensor] = ()
    bytes: ActivationBytes = field(default_factory=ActivationBytes)
    _param_keys: set[tuple[str, int]] = field(default_factory=set)
    _seen: StorageSet = field(default_factory=StorageSet)
    _held: StorageSet = field(default_factory=StorageSet)
    _live: list[int] = field(default_factory=lambda: [0])  # a list: the finalizers hold it, not the counter

    def __post_init__(self) -> None:
        self._param_keys = {storage_key(p) for p in self.parameters}
        self.parameters = ()

    @classmethod
    def for_module(cls, module: nn.Module) -> SavedTensorCounter:
        return cls(parameters=list(module.parameters()))

    def is_parameter(self, tensor: torch.Tensor) -> bool:
        """A weight, not an activation: one of the module's storages as built, or a parameter (or a view of
        one) made later: ZeRO-3 and FSDP2 gather each weight into a new storage for every forward."""
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return True
        return storage_key(tensor) in self._param_keys

    def reset(self) -> None:
        self.bytes = ActivationBytes()
        self._seen.clear()
        self._held.clear()
        self._live = [0]

    def alive_now(self) -> int:
        """Bytes of this step's counted storages alive at this moment."""
        return self._live[0]

    def _alive(self, tensor: torch.Tensor, num_bytes: int) -> None:
        """Count ``num_bytes`` as alive until the tensor's storage is freed; update the peak."""
        live = self._live
        live[0] += num_bytes
        self.bytes.peak = max(self.bytes.peak, live[0])
        weakref.finalize(local_tensor(tensor).untyped_storage(), _release, live, num_bytes)

    # ---- what the savers report ----------------------------------------------------------

    def saw(self, tensor: torch.Tensor) -> bool:
        """A saved activation; returns whether its storage is new (counted now)."""
        self.bytes.tensors += 1
        if tensor in self._seen or tensor in self._held:
            return False
        self._seen.add(tensor)
        self.bytes.saved += _storage_bytes(tensor)
        self._alive(tensor, _storage_bytes(tensor))
        return True

    def stored(self, num_bytes: int, *, offloaded: bool) -> None:
        self.bytes.stored += num_bytes
        if offloaded:
            self.bytes.offloaded += num_bytes

    def kept_instead(self, tensor: torch.Tensor, piece: torch.Tensor) -> None:
        """A saved tensor held as ``piece`` (a gathered input's slice, ``memory/regather.py``): its storage is
        saved as produced, ``piece`` is what stays alive until backward."""
        if self.saw(tensor):
            num_bytes = _storage_bytes(piece)
            self.stored(num_bytes, offloaded=False)
            self._alive(piece, num_bytes)

    def hold(self, tensors: Iterable[Any], kind: str) -> None:
        """Tensors a checkpointed region keeps: ``"inputs"`` or ``"kept"`` (selective outputs)."""
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or self.is_parameter(tensor):
                continue
            if tensor in self._held or tensor in self._seen:
                continue
            self._held.add(tensor)
            self._alive(tensor, _storage_bytes(tensor))
            if kind == "inputs":
                self.bytes.recompute_inputs += _storage_bytes(tensor)
            else:
                self.bytes.recompute_kept += _storage_bytes(tensor)

    # ---- a plain counting context (no saver) ---------------------------------------------

    def kept(self, tensor: torch.Tensor) -> None:
        """A saved tensor held for backward as it is (on the device, not compressed)."""
        if self.saw(tensor):
            self.stored(_storage_bytes(tensor), offloaded=False)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.is_parameter(tensor):
            return tensor
        self.kept(tensor)
        return kept_as_is(tensor)


def _release(live: list[int], num_bytes: int) -> None:
    live[0] -= num_bytes


_ACTIVE: list[SavedTensorCounter] = []


def active_counter() -> SavedTensorCounter | None:
    """The innermost counter entered with :func:`counting` or a saver's context, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def activate(counter: SavedTensorCounter | None) -> Iterator[None]:
    """Make ``counter`` the one checkpoint wrappers and savers report to (no hooks installed)."""
    if counter is None:
        yield
        return
    _ACTIVE.append(counter)
    try:
        yield
    finally:
        _ACTIVE.remove(counter)


@contextmanager
def counting(counter: SavedTensorCounter) -> Iterator[SavedTensorCounter]:
    """Count the activations of the forward passes run inside (no offload, no compression)."""
    with activate(counter), torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda t: t):
        yield counter
