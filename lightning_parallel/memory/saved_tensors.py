"""Activations saved for backward, offloaded to host memory and/or stored in a smaller format.

One pair of ``torch.autograd.graph.saved_tensors_hooks`` does both (hooks do not nest: the
innermost pair receives every saved tensor, so offload and compression must be one pair):

- **compression** (the idea of Gist, Jain et al. 2018): a floating-point activation is stored
  as ``bf16`` (round to nearest: relative error at most 2^-9 per element) or ``fp8`` (e4m3 with
  one fp32 scale per tensor: relative error at most 2^-4) and cast back when the backward pass
  needs it. The forward pass is untouched, so the loss of a step is exact; only gradients see
  the rounding (see docs/memory.md for its measured effect).
- **offload**: the (possibly compressed) activation is copied to host memory and comes back when
  the backward pass needs it. On a GPU both directions run on one side stream: the copy out
  waits for the kernels that made the activation and overlaps the next ones (the device memory
  is kept, ``record_stream``, until it is done), and a copy back can never overtake the copy out
  of the same host buffer. Host buffers are pinned and reused from step to step (:class:`HostBuffers`),
  not allocated per storage per step. Copies back are prefetched one block ahead: the first activation
  the backward pass unpacks from block ``i`` starts the copies of block ``i - 1``'s. The last block's
  activations (and the head's after it) are not offloaded: backward needs them first, so they would
  come back at once, with nothing to overlap. On a CPU-only machine host and device are the same
  memory: the copies still run (so the code path is the one a GPU runs), they just save nothing.

Parameters (weights saved by matmuls) are never touched, and neither are their casts: under
autocast a matmul saves the low-precision copy of its weight, which is no activation (offloading it
moved every weight to the host and back each step, and fp8 compression rounded the weights).
DTensor activations (tensor parallelism) are handled through their local shard and rebuilt with the
same placements.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_parallel.memory.counting import (
    SavedTensorCounter,
    activate,
    active_counter,
    counting,
    local_tensor,
    storage_key,
)

__all__ = ["COMPRESSIONS", "ActivationSaver", "compress", "decompress", "saved_tensors_context"]

Compression = Literal["bf16", "fp8"]
COMPRESSIONS: tuple[str, ...] = ("bf16", "fp8")
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)


def compress(tensor: torch.Tensor, kind: Compression) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(stored, scale)`` for a floating-point tensor worth compressing, else ``None``."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    if kind == "bf16":
        if tensor.element_size() <= 2:
            return None
        return tensor.to(torch.bfloat16), None
    if tensor.element_size() <= 1:
        return None
    # Finite values only: a storage may hold bytes no saved view covers (never read back).
    amax = torch.nan_to_num(tensor.detach().abs().float(), nan=0.0, posinf=0.0).amax()
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    return (tensor.float() / scale).to(_FP8), scale


def decompress(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return stored.to(dtype)
    return (stored.float() * scale.to(stored.device)).to(dtype)


class HostBuffers:
    """Host buffers for offloaded storages, reused across steps (pinned allocations are slow).

    A buffer comes back to the pool when the storage that used it is garbage (its backward is done).
    On a GPU every copy into or out of a buffer runs on the saver's one side stream, in order, so a
    buffer reused by a later copy out cannot be overwritten before an earlier copy back has read it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}
        self.allocated = 0  # buffers made (the rest of the requests were served from the pool)

    def take(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        free = self._free.get((dtype, numel, pin))
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)

    def give(self, buffer: torch.Tensor, pin: bool) -> None:
        self._free.setdefault((buffer.dtype, buffer.numel(), pin), []).append(buffer)


class _StoredStorage:
    """One storage of saved activations as the saver keeps it: compressed and/or in host memory.

    Every saved view of the storage (``q``, ``k`` and ``v`` of one fused projection, a tensor
    and its reshaped copy) shares this one object, so nothing is compressed or copied twice.
    """

    __slots__ = (
        "data", "scale", "dtype", "device", "numel", "group", "offloaded", "ready", "event", "live", "__weakref__"
    )  # fmt: skip

    def __init__(
        self,
        flat: torch.Tensor,
        compression: Compression | None,
        offload: bool,
        group: int,
        buffers: HostBuffers,
        stream: Any = None,
    ) -> None:
        self.dtype, self.device, self.numel, self.group = flat.dtype, flat.device, flat.numel(), group
        self.offloaded = offload  # in host memory (on a CPU-only machine: a second copy in the same memory)
        packed = compress(flat, compression) if compression else None
        data, self.scale = packed if packed is not None else (flat, None)
        if offload:
            pin = stream is not None
            host = buffers.take(data.numel(), data.dtype, pin)
            weakref.finalize(self, buffers.give, host, pin)
            if stream is None:
                host.copy_(data.reshape(-1))
            else:  # after the kernels that made it, beside the ones that follow
                stream.wait_stream(torch.cuda.current_stream(data.device))
                with torch.cuda.stream(stream):
                    host.copy_(data.reshape(-1), non_blocking=True)
                data.record_stream(stream)
            data = host.view(data.shape)
        self.data = data
        self.ready: torch.Tensor | None = None  # the copy back, once prefetched
        self.event: Any = None
        self.live: weakref.ref | None = None  # the restored storage, while backward uses it

    @property
    def copies(self) -> bool:
        return self.offloaded or self.data.dtype != self.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (4 if self.scale is not None else 0)

    def prefetch(self, stream: Any) -> None:
        if not self.offloaded or self.ready is not None or self._alive() is not None:
            return
        if stream is None:  # CPU (or no side stream): the same copy, synchronously
            self.ready = self.data.to(self.device, copy=True)
            return
        with torch.cuda.stream(stream):
            self.ready = self.data.to(self.device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def _alive(self) -> torch.UntypedStorage | None:
        return self.live() if self.live is not None else None

    def restore(self, stream: Any = None) -> torch.Tensor:
        """The whole storage, back on the device in its dtype (shared while backward uses it)."""
        storage = self._alive()
        if storage is not None:
            return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage)
        data = self.data
        if self.offloaded:
            if self.ready is None:
                self.prefetch(stream)  # not prefetched: now, on the side stream all the same
            data = self.ready
            assert data is not None
            if self.event is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(self.event)
                data.record_stream(current)
            # kept until this storage is garbage: a second use later in backward finds it on the device
            self.event = None
        full = decompress(data, self.scale, self.dtype) if data.dtype != self.dtype else data
        self.live = weakref.ref(full.untyped_storage())
        return full


class _SavedView:
    """A saved activation: where it lies in a :class:`_StoredStorage`, and its DTensor layout."""

    __slots__ = ("stored", "geometry", "spec")

    def __init__(self, tensor: torch.Tensor, local: torch.Tensor, stored: _StoredStorage) -> None:
        self.stored = stored
        self.geometry = (local.storage_offset(), tuple(local.shape), local.stride())
        self.spec = (
            (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            if isinstance(tensor, DTensor)
            else None
        )

    def restore(self, stream: Any = None) -> torch.Tensor:
        offset, shape, stride = self.geometry
        local = self.stored.restore(stream).as_strided(shape, stride, offset)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Kept:
    """A saved tensor left on the device whose unpacking still starts the prefetch of the block before."""

    __slots__ = ("tensor", "group")

    def __init__(self, tensor: torch.Tensor, group: int) -> None:
        self.tensor, self.group = tensor, group


_VIEWS = {"TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0",
          "ExpandBackward0", "AliasBackward0"}  # fmt: skip


def is_parameter_cast(tensor: torch.Tensor) -> bool:
    """A copy of a parameter made by a cast (autocast's low-precision weight), or a view of one (a linear
    saves its cast weight transposed), not an activation."""
    fn = tensor.grad_fn
    for _ in range(4):
        if fn is None or type(fn).__name__ not in _VIEWS or not fn.next_functions:
            break
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]
    return isinstance(getattr(source, "variable", None), nn.Parameter)


class ActivationSaver:
    """Saved-tensor hooks that compress and/or offload activations; use :meth:`context` around forward.

    Args:
        compression: ``"bf16"``, ``"fp8"`` or ``None``.
        offload: keep saved activations in host memory until the backward pass.
        parameters: the model's parameters: saved weights are left alone.
        blocks: the repeated blocks, in forward order: offloaded activations are grouped by the
            block that produced them, so the backward pass can prefetch the previous block's.
    """

    def __init__(
        self,
        compression: Compression | None = None,
        offload: bool = False,
        parameters: Sequence[torch.Tensor] = (),
        blocks: Sequence[nn.Module] = (),
    ) -> None:
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS} or None, got {compression!r}")
        self.compression = compression
        self.offload = offload
        self._param_keys = {storage_key(p) for p in parameters}
        # Storages packed in this step, weakly keyed by the live storage (see StorageSet).
        self._stored: dict[tuple[str, int], tuple[weakref.ref, _StoredStorage]] = {}
        self._groups: dict[int, list[weakref.ref[_StoredStorage]]] = {}
        self._prefetched: set[int] = set()
        self._block_entries = 0
        self._blocks = len(blocks)
        self._stream: Any = None
        self.buffers = HostBuffers()
        self.handles: list[RemovableHandle] = [b.register_forward_pre_hook(self._enter_block) for b in blocks]

    @property
    def enabled(self) -> bool:
        return self.offload or self.compression is not None

    def _enter_block(self, module: nn.Module, args: Any) -> None:
        self._block_entries += 1

    @contextmanager
    def context(self, counter: SavedTensorCounter | None = None) -> Iterator[None]:
        """Forward passes inside save their activations through this saver (and ``counter``)."""
        self._groups.clear()  # the previous step's backward has finished
        self._prefetched.clear()
        self._block_entries = 0
        try:
            with activate(counter), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._stored.clear()

    # ---- hooks ---------------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> Any:
        """The one stream of every host copy, on a GPU (None on the CPU: the copies are synchronous)."""
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _in_last_block(self) -> bool:
        """Packing the last block's activations (or the head's after it): backward needs them first."""
        return self._blocks > 0 and self._block_entries > 0 and self._block_entries % self._blocks == 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = storage_key(tensor)
        if key in self._param_keys or isinstance(tensor, nn.Parameter):
            return tensor
        counter = active_counter()
        if is_parameter_cast(tensor):  # held for backward (counted as without a saver), but no activation
            if counter is not None:
                counter.kept(tensor)
            return tensor
        new_storage = counter.saw(tensor) if counter is not None else True
        local = local_tensor(tensor)
        storage = local.untyped_storage()
        hit = self._stored.get(key)
        stored = hit[1] if hit is not None and hit[0]() is not None else None
        if stored is None:
            offload = self.offload and not self._in_last_block()
            with torch.no_grad():
                flat = torch.empty(0, dtype=local.dtype, device=local.device).set_(storage)
                stored = _StoredStorage(
                    flat, self.compression, offload, self._block_entries, self.buffers,
                    self._side_stream(local.device) if offload else None,
                )  # fmt: skip
            self._stored[key] = (weakref.ref(storage), stored)
            if stored.offloaded:
                self._groups.setdefault(stored.group, []).append(weakref.ref(stored))
            if counter is not None and (stored.copies or new_storage):
                counter.stored(stored.nbytes, offloaded=stored.offloaded)
        if not stored.copies:
            # nothing to do (an fp16 tensor under bf16 compression, an integer index, the last block's)
            return _Kept(tensor, stored.group) if self.offload else tensor
        return _SavedView(tensor, local, stored)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Kept):
            self._prefetch(packed.group - 1, packed.tensor.device)
            return packed.tensor
        if self.offload:
            self._prefetch(packed.stored.group - 1, packed.stored.device)
        return packed.restore(self._side_stream(packed.stored.device) if packed.stored.offloaded else None)

    def _prefetch(self, group: int, device: torch.device) -> None:
        """Start bringing back the activations of the block before ``group`` (once per step)."""
        if group < 0 or group in self._prefetched:
            return
        self._prefetched.add(group)
        stream = self._side_stream(device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        for ref in self._groups.get(group, []):
            stored = ref()
            if stored is not None:
                stored.prefetch(stream)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextmanager
def saved_tensors_context(
    saver: ActivationSaver | None, counter: SavedTensorCounter | None
) -> Iterator[None]:
    """One training step's saved activations through ``saver`` and counted by ``counter`` (either may be None)."""
    if counter is not None:
        counter.reset()
    if saver is not None:
        with saver.context(counter):
            yield
    elif counter is not None:
        with counting(counter):
            yield
    else:
        yield
