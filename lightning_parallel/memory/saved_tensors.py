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
  come back at once, with nothing to overlap. Under pipeline stages "block ``i``" is a block of one
  stage's forward of one micro-batch (:data:`BlockGroup`): a rank holding two stages keeps each stage's
  last block, and never prefetches another micro-batch's or stage's activations early. On a CPU-only
  machine host and device are the same memory: the copies still run (so the code path is the one a GPU
  runs), they just save nothing.

Parameters (weights saved by matmuls) are never touched, and neither are their casts: under
autocast a matmul saves the low-precision copy of its weight, which is no activation (offloading it
moved every weight to the host and back each step, and fp8 compression rounded the weights); with a
:class:`~lightning_parallel.memory.casts.CastSaver` it is not kept at all, cast again in backward.
How one storage is kept (formats, host buffers): ``stored.py``.
DTensor activations (tensor parallelism) are handled through their local shard and rebuilt with the
same placements.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_parallel.memory.casts import CastSaver, WeightCastReference, cast_parameter
from lightning_parallel.memory.counting import (
    SavedTensorCounter,
    activate,
    active_counter,
    counting,
    kept_as_is,
    local_tensor,
    storage_key,
)
from lightning_parallel.memory.regather import GatheredInputSaver, _SavedSlice
from lightning_parallel.memory.stored import (
    COMPRESSIONS,
    Compression,
    HostBuffers,
    _SavedView,
    _StoredStorage,
    compress,
    decompress,
)

__all__ = ["COMPRESSIONS", "ActivationSaver", "compress", "decompress", "saved_tensors_context"]


# (stage, forward of that stage, block position in the stage; -1 before its first block): where a saved
# activation was made. The forward is the micro-batch under pipeline stages, else a count of the stage's forwards.
BlockGroup = tuple[int, int, int]
# (stage, micro-batch) whose forward runs now, or None outside one (a recomputation in backward)
RunningForward = Callable[[], "tuple[int, int] | None"]


class _Kept:
    """A saved tensor left on the device whose unpacking still starts the prefetch of the block before."""

    __slots__ = ("tensor", "group")

    def __init__(self, tensor: torch.Tensor, group: BlockGroup | None) -> None:
        self.tensor, self.group = tensor, group


def _before(group: BlockGroup | None) -> BlockGroup | None:
    """The group the backward pass needs next within the same stage and micro-batch (None at the stage's start,
    or for what was packed outside a forward)."""
    if group is None:
        return None
    stage, forward, position = group
    return (stage, forward, position - 1) if position >= 0 else None


def is_parameter_cast(tensor: torch.Tensor) -> bool:
    """A copy of a parameter made by a cast (autocast's low-precision weight), or a view of one (a linear
    saves its cast weight transposed), not an activation."""
    return cast_parameter(tensor) is not None


class ActivationSaver:
    """Saved-tensor hooks that compress and/or offload activations; use :meth:`context` around forward.

    Args:
        compression: ``"bf16"``, ``"fp8"`` or ``None``.
        offload: keep saved activations in host memory until the backward pass.
        parameters: the model's parameters: saved weights are left alone.
        blocks: the repeated blocks, in forward order: offloaded activations are grouped by the
            block that produced them, so the backward pass can prefetch the previous block's.
        block_stages: under pipeline stages, the stage of each of ``blocks`` (a rank holding several
            stages runs the model's forward once per stage, passing through the other stages' blocks).
        running: under pipeline stages, the (stage, micro-batch) whose forward runs now; entries of
            blocks outside one (a recomputation in backward) or of another stage's blocks are not counted.
    """

    def __init__(
        self,
        compression: Compression | None = None,
        *,
        offload: bool = False,
        parameters: Sequence[torch.Tensor] = (),
        blocks: Sequence[nn.Module] = (),
        block_stages: Sequence[int] | None = None,
        running: RunningForward | None = None,
    ) -> None:
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS} or None, got {compression!r}")
        self.compression = compression
        self.offload = offload
        self._param_keys = {storage_key(p) for p in parameters}
        # Storages packed in this step and what is stored for them, both weakly: the graph's saved views keep a
        # stored copy, and it goes with their backward (under pipeline stages the context spans the schedule:
        # held here, every micro-batch's copies stayed until the step ended).
        self._stored: dict[tuple[str, int], tuple[weakref.ref, weakref.ref[_StoredStorage]]] = {}
        self._groups: dict[BlockGroup, list[weakref.ref[_StoredStorage]]] = {}
        self._prefetched: set[BlockGroup] = set()
        stages = list(block_stages) if block_stages is not None else [0] * len(blocks)
        if len(stages) != len(blocks):
            raise ValueError(f"block_stages names {len(stages)} stages for {len(blocks)} blocks")
        positions = [stages[:i].count(s) for i, s in enumerate(stages)]
        self._stage_blocks = {s: stages.count(s) for s in stages}
        self._running = running
        self._forwards: dict[int, int] = {}  # forwards of each stage counted (without ``running``)
        self._at: BlockGroup = (0, 0, -1)
        self._stream: Any = None
        self.buffers = HostBuffers()
        self._placed = list(zip(blocks, stages, positions, strict=True))
        self.handles: list[RemovableHandle] = []
        self.attach()
        self._casts: CastSaver | None = None
        self._regather: GatheredInputSaver | None = None

    @property
    def enabled(self) -> bool:
        return self.offload or self.compression is not None

    def _entry_hook(self, stage: int, position: int) -> Callable[[nn.Module, Any], None]:
        def enter(module: nn.Module, args: Any) -> None:
            if self._running is None:
                if position == 0:
                    self._forwards[stage] = self._forwards.get(stage, -1) + 1
                self._at = (stage, self._forwards.get(stage, 0), position)
                return
            running = self._running()
            if running is not None and running[0] == stage:
                self._at = (stage, running[1], position)

        return enter

    def _group(self) -> BlockGroup | None:
        """Where the tensor packed now was made; None outside a stage's forward (kept on the device)."""
        if self._running is None:
            return self._at
        running = self._running()
        if running is None:
            return None
        return self._at if self._at[:2] == running else (*running, -1)

    @contextmanager
    def context(
        self,
        counter: SavedTensorCounter | None = None,
        casts: CastSaver | None = None,
        regather: GatheredInputSaver | None = None,
    ) -> Iterator[None]:
        """Forward passes inside save their activations through this saver (and ``counter``; ``casts``:
        16-bit casts kept once or not at all, ``memory/casts.py``; ``regather``: gathered inputs kept as
        this rank's slice, ``memory/regather.py``, never offloaded or compressed)."""
        self._groups.clear()  # the previous step's backward has finished
        self._prefetched.clear()
        self._forwards.clear()
        self._at = (0, 0, -1)
        self._casts, self._regather = casts, regather
        try:
            with activate(counter), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._stored.clear()
            self._casts = self._regather = None

    # ---- hooks ---------------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> Any:
        """The one stream of every host copy, on a GPU (None on the CPU: the copies are synchronous)."""
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _stays(self, group: BlockGroup | None) -> bool:
        """Made in a stage's last block (or its head after it), or outside a forward: backward needs it first."""
        if group is None:
            return True
        stage, _, position = group
        return position >= 0 and position == self._stage_blocks.get(stage, 0) - 1

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = storage_key(tensor)
        if key in self._param_keys or isinstance(tensor, nn.Parameter):
            return tensor
        if local_tensor(tensor).untyped_storage().nbytes() == 0:  # a DTensor's empty shard too
            # no data (torch 2.11's checkpoint saves an empty CPU tensor per region beside its inputs): its
            # shared key ("cpu", 0) would make one group of every region's, fetched back at backward's start
            return kept_as_is(tensor)
        if self._casts is not None:
            packed = self._casts.pack(tensor)
            if isinstance(packed, WeightCastReference):
                return packed
            tensor, key = packed, storage_key(packed)  # an equal copy already kept: its storage
        counter = active_counter()
        if is_parameter_cast(tensor):  # held for backward (counted as without a saver), but no activation
            if counter is not None:
                counter.kept(tensor)
            return kept_as_is(tensor)
        sliced = self._regather.pack(tensor) if self._regather is not None else None
        if sliced is not None:
            return sliced
        new_storage = counter.saw(tensor) if counter is not None else True
        local = local_tensor(tensor)
        storage = local.untyped_storage()
        hit = self._stored.get(key)
        stored = hit[1]() if hit is not None and hit[0]() is not None else None
        if stored is None:
            group = self._group()
            offload = self.offload and not self._stays(group)
            with torch.no_grad():
                flat = torch.empty(0, dtype=local.dtype, device=local.device).set_(storage)
                stored = _StoredStorage(
                    flat,
                    self.compression,
                    offload=offload,
                    group=group,
                    buffers=self.buffers,
                    stream=self._side_stream(local.device) if offload else None,
                )
            self._stored[key] = (weakref.ref(storage), weakref.ref(stored))
            if stored.offloaded:
                self._groups.setdefault(stored.group, []).append(weakref.ref(stored))
            if counter is not None and (stored.copies or new_storage):
                counter.stored(stored.nbytes, offloaded=stored.offloaded)
        if not stored.copies:
            # nothing to do (an fp16 tensor under bf16 compression, an integer index, the last block's)
            return _Kept(kept_as_is(tensor), stored.group) if self.offload else kept_as_is(tensor)
        return _SavedView(tensor, local, stored)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, (WeightCastReference, _SavedSlice)):
            return packed.restore()
        if isinstance(packed, _Kept):
            self._prefetch(_before(packed.group), packed.tensor.device)
            return packed.tensor
        if self.offload:
            self._prefetch(_before(packed.stored.group), packed.stored.device)
        return packed.restore(self._side_stream(packed.stored.device) if packed.stored.offloaded else None)

    def _prefetch(self, group: BlockGroup | None, device: torch.device) -> None:
        """Start bringing back the activations of ``group``, the block before the one unpacked (once per step)."""
        if group is None or group in self._prefetched:
            return
        self._prefetched.add(group)
        stream = self._side_stream(device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        for ref in self._groups.get(group, []):
            stored = ref()
            if stored is not None:
                stored.prefetch(stream)

    def attach(self) -> None:
        """Install the hooks on the blocks (again, after :meth:`remove`) that tell where an activation was made."""
        self.remove()
        self.handles = [
            block.register_forward_pre_hook(self._entry_hook(stage, position))
            for block, stage, position in self._placed
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextmanager
def saved_tensors_context(
    saver: ActivationSaver | None,
    counter: SavedTensorCounter | None,
    casts: CastSaver | None = None,
    regather: GatheredInputSaver | None = None,
) -> Iterator[None]:
    """One training step's saved activations through ``saver``, counted by ``counter``, its 16-bit casts
    kept once or not at all by ``casts``, its gathered inputs kept as slices by ``regather`` (any may be None)."""
    if counter is not None:
        counter.reset()
    if casts is not None:
        casts.reset()
    if regather is not None:
        regather.reset()
    if saver is not None:
        with saver.context(counter, casts, regather):
            yield
    elif casts is not None or regather is not None:
        with (
            activate(counter),
            torch.autograd.graph.saved_tensors_hooks(_packer(counter, casts, regather), _unpack),
        ):
            yield
    elif counter is not None:
        with counting(counter):
            yield
    else:
        yield


def _packer(
    counter: SavedTensorCounter | None, casts: CastSaver | None, regather: GatheredInputSaver | None
) -> Any:
    def pack(tensor: torch.Tensor) -> Any:
        if counter is not None and counter.is_parameter(tensor):
            return tensor
        packed = casts.pack(tensor) if casts is not None else tensor
        if isinstance(packed, torch.Tensor) and regather is not None and not is_parameter_cast(packed):
            sliced = regather.pack(packed)
            if sliced is not None:
                return sliced
        if not isinstance(packed, torch.Tensor):
            return packed
        if counter is not None:
            counter.kept(packed)  # a shared copy's storage counts once
        return kept_as_is(packed)

    return pack


def _unpack(packed: Any) -> torch.Tensor:
    return packed.restore() if isinstance(packed, (WeightCastReference, _SavedSlice)) else packed
