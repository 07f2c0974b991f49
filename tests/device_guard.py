"""On CPU, catch the tensors NCCL would refuse: host tensors the project hands to a collective.

Under gloo every tensor is on the CPU, so a flag made with ``torch.tensor([1])`` (no device) passes
every CPU test and ends the first GPU job at its first collective. :class:`HostTensorGuard` marks,
while training runs, the tensors the project's own code puts on the host: factory calls from
``lightning_parallel`` without a device (or with the CPU spelled out: ``"cpu"``, ``torch.device("cpu")``),
``.cpu()``, ``.to("cpu")`` and ``.to(torch.device("cpu"))`` (:func:`spelled_host`),
and whatever is computed from marked tensors alone (a marked tensor mixed with a model tensor
becomes a model-device tensor on a GPU, so the mark stops there). The device the project's helper
names for a group (``comm/agreement.py: communication_device``) is what a GPU run would get; the
guard swaps it for ``cpu:0``, a device the CPU computes on like any other but which no mistake
spells, so tensors made on it are never marked. Every collective of ``torch.distributed`` is wrapped:
a marked tensor among its arguments is recorded with the place it was made.
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

BLESSED = torch.device("cpu", 0)  # what communication_device returns under the guard
MARK = "_lp_host_origin"
MODE_FILES = ("device_guard.py", "sync_counter.py")  # frames of the modes themselves, skipped
# A mode's handler hands the call it intercepted on (the project's own modes too: vocab_loss.py's sees every
# function of a step that touches the sharded logits): the caller is the frame above it.
PASS_THROUGH = frozenset({"__torch_function__", "__torch_dispatch__"})

FACTORIES = {
    torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.as_tensor,
    torch.randn, torch.rand, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor,
}  # fmt: skip
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "gather", "scatter", "reduce", "batch_isend_irecv",
)  # fmt: skip


def project_frame(through_torch: bool = False) -> FrameType | None:
    """The frame of the project's code that called the torch function being handled, or None when the
    caller is not the project's. The modes' own frames are skipped; ``through_torch``: torch's too (a
    kernel reached from the project through torch's Python code is charged to the project; a factory is
    not: torch's own factories, e.g. inside ``all_gather_object``, pick their device themselves)."""
    skipped = (*MODE_FILES, "contextlib", *(("/torch/",) if through_torch else ()))
    frame = sys._getframe(1)
    while frame is not None and (
        any(part in frame.f_code.co_filename for part in skipped) or frame.f_code.co_name in PASS_THROUGH
    ):
        frame = frame.f_back
    if frame is None or "/lightning_parallel/" not in frame.f_code.co_filename:
        return None
    return frame


def project_line(through_torch: bool = False, frame: FrameType | None = None) -> str | None:
    """``file:line`` of :func:`project_frame` (or of ``frame``), or None."""
    frame = frame or project_frame(through_torch)
    if frame is None:
        return None
    return f"{frame.f_code.co_filename.split('/lightning_parallel/')[-1]}:{frame.f_lineno}"


_SPELLED_CPU = re.compile(r"""device\(\s*["']cpu["']""")  # torch.device("cpu") on the calling line


def spelled_host(device: Any, frame: FrameType | None) -> bool:
    """``device`` is the host because the project's code at ``frame`` says so: ``"cpu"``, or a
    ``torch.device("cpu")`` written on the calling line or held in a module constant of its file.

    On the CPU a parameter's device is ``torch.device("cpu")`` too, and on a GPU it is the GPU: a device
    object is charged to the host only where the code spells the CPU, not where it passes one it read."""
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    if not isinstance(device, torch.device) or device.type != "cpu" or device.index is not None:
        return False  # cpu:0 is what the guard hands out for the communication device (BLESSED)
    if frame is None:
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    constant = any(value is device for value in frame.f_globals.values())
    return bool(_SPELLED_CPU.search(line)) or constant


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _is_host(device: Any, frame: FrameType | None = None) -> bool:
    """A device a GPU run would also put on the host: none given, or the CPU spelled out (:func:`spelled_host`)."""
    if device is None:
        return True
    return spelled_host(device, frame)


def is_host_tensor(tensor: Any) -> bool:
    """Made on the host by the project's code (marked by :class:`HostMarking`): on a GPU it would be too."""
    return getattr(tensor, MARK, None) is not None


class HostMarking(TorchFunctionMode):
    """Marks the host tensors the project's code makes, and what is computed from them alone."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        origin = None
        if func in FACTORIES:
            frame = project_frame()
            if frame is not None and _is_host(kwargs.get("device"), frame):
                origin = project_line(frame=frame)
        elif func in (torch.Tensor.cpu,) or func is torch.Tensor.to:
            frame = project_frame()
            targets = (*args[1:2], kwargs.get("device"))
            if frame is not None and (
                func is torch.Tensor.cpu or any(a is not None and _is_host(a, frame) for a in targets)
            ):
                origin = project_line(frame=frame)
        else:
            inputs = _tensors((args, kwargs))
            marks = [getattr(t, MARK, None) for t in inputs]
            if inputs and all(marks):
                origin = marks[0]
        if origin is not None:
            for tensor in _tensors(out):
                if not isinstance(tensor, torch.nn.Parameter):
                    try:
                        setattr(tensor, MARK, origin)
                    except (AttributeError, RuntimeError):
                        pass
        return out


@dataclass
class HostTensorGuard:
    """Records ``(collective, where the host tensor was made)`` for every marked tensor a collective got."""

    violations: list[tuple[str, str]] = field(default_factory=list)
    collectives: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _wrap(self, name: str, original: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            self.collectives += 1
            for tensor in _tensors((args, kwargs, [getattr(a, "tensor", None) for a in _p2p_ops(args)])):
                origin = getattr(tensor, MARK, None)
                if origin is not None:
                    with self._lock:
                        self.violations.append((name, origin))
            return original(*args, **kwargs)

        return collective

    @contextmanager
    def watching(self) -> Iterator[HostTensorGuard]:
        """Collectives wrapped, the helper's device swapped for :data:`BLESSED`, marking on (this thread)."""
        from torch.distributed import distributed_c10d

        import lightning_parallel.comm.agreement as agreement

        # Both bindings alike: ``P2POp`` compares its op with c10d's own ``isend``/``irecv``.
        modules = (dist, distributed_c10d)
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        helpers = _helper_bindings(agreement.communication_device)
        for name, fn in originals.items():
            wrapped = self._wrap(name, fn)
            for module in modules:
                setattr(module, name, wrapped)
        for module, attr in helpers:
            setattr(module, attr, lambda group=None: BLESSED)
        try:
            with HostMarking():
                yield self
        finally:
            for name, fn in originals.items():
                for module in modules:
                    setattr(module, name, fn)
            for module, attr in helpers:
                setattr(module, attr, agreement.communication_device)


def _p2p_ops(args: tuple) -> list[Any]:
    return [op for op in (args[0] if args and isinstance(args[0], list) else []) if hasattr(op, "tensor")]


def _helper_bindings(helper: Any) -> list[tuple[Any, str]]:
    """Every ``(module, name)`` of the project bound to the device helper (``from ... import`` copies it)."""
    return [
        (module, attr)
        for name, module in list(sys.modules.items())
        if name.startswith("lightning_parallel") and module is not None
        for attr, value in list(vars(module).items())
        if value is helper
    ]
