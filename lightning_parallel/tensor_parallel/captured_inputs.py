"""What the block verification runs a block on: the arguments it really received in the sampled step.

The probe (:class:`BlockInputCapture`) keeps a detached copy of each block's first arguments; the verification
then runs each block on fresh copies of them in fp32 (:func:`block_inputs`), the sharded copy on what the
sharded earlier blocks would have handed it (:func:`stored_by_sharded_blocks`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.compat import tree_map
from lightning_parallel.tensor_parallel.regions import find_hidden, replace_hidden

__all__ = [
    "BlockInputCapture",
    "Captured",
    "block_inputs",
    "capture_block_inputs",
    "stored_by_sharded_blocks",
]


class _CaptureDone(Exception):
    pass


Captured = tuple[tuple[Any, ...], dict[str, Any]]


class BlockInputCapture:
    """Keeps a copy of what each of ``blocks`` receives the first time it is called.

    A probe on the one sampled step at setup (``parallelize/sample.py``), which may run with
    autograd on (the pipeline discovery shares the run): tensors are kept detached, as a
    ``no_grad`` run would have produced them. An argument that cannot be copied off the graph
    (an object holding tensors of the graph) leaves its block in ``missing``, captured again by
    :func:`capture_block_inputs` alone.
    """

    needs_grad = False

    def __init__(self, blocks: dict[str, nn.Module], *, stop_when_done: bool = False) -> None:
        self.blocks = blocks
        self.stop_when_done = stop_when_done
        self.captured: dict[str, Captured] = {}
        self.missing: set[str] = set()
        self._handles: list[Any] = []

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in self.captured and name not in self.missing:
                try:
                    self.captured[name] = copy.deepcopy(_detached((args, kwargs)))
                except RuntimeError:  # a non-leaf tensor inside an object: not copyable under autograd
                    self.missing.add(name)
            if self.stop_when_done and len(self.captured) == len(self.blocks):
                raise _CaptureDone

        return hook

    def attach(self) -> None:
        self._handles = [
            block.register_forward_pre_hook(self._hook(n), with_kwargs=True)
            for n, block in self.blocks.items()
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def finish(self, output: Any) -> None:
        """Nothing to compute from the step's output."""


def _detached(value: Any) -> Any:
    """Tensors (also inside tuples, lists and dicts) off the autograd graph, for ``deepcopy``."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_detached(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def capture_block_inputs(run_step: Callable[[], Any], blocks: dict[str, nn.Module]) -> dict[str, Captured]:
    """Run ``run_step`` (no grad) until every block in ``blocks`` has been called once; keep its inputs."""
    capture = BlockInputCapture(blocks, stop_when_done=True)
    capture.attach()
    try:
        with torch.no_grad():
            run_step()
    except _CaptureDone:
        pass
    finally:
        capture.detach()
    return capture.captured


def block_inputs(
    inputs: Captured, dtype: torch.dtype = torch.float32
) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
    """A fresh copy of a block's captured arguments in ``dtype``, with the hidden state a leaf that takes a gradient.

    The check runs in fp32 whatever the training precision: floating inputs (masks, rotary tables)
    are cast too.
    """

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    args, kwargs = tree_map(cast, copy.deepcopy(inputs))
    where, hidden = find_hidden(args, kwargs)
    hidden = hidden.detach().to(dtype).requires_grad_(True)
    args, kwargs = replace_hidden(args, kwargs, where, hidden)
    return args, kwargs, hidden


def stored_by_sharded_blocks(inputs: Captured, mesh: DeviceMesh) -> Captured:
    """A block's captured arguments with what earlier blocks stored for it in a container as the sharded
    earlier blocks store it: keys and values shared across layers (Gemma 3n's and Kolibri's
    ``shared_kv_states``, ``(batch, heads, positions, head_dim)`` in a dict every block receives) hold this
    rank's heads only. The captures come from the unsharded model, so the later block would otherwise be
    checked on every head's keys and values, which it never receives when it trains."""
    rank, size = mesh.get_local_rank(), mesh.size()

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[1] % size == 0:
            heads = value.shape[1] // size
            return value.narrow(1, rank * heads, heads)
        return value

    def entries_cut(value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        held = copy.copy(value)  # of its own type (Hugging Face's KVSharingDict is a UserDict)
        for key in list(held):
            held[key] = tree_map(cut, held[key])
        return held

    args, kwargs = inputs
    return tuple(entries_cut(a) for a in args), {k: entries_cut(v) for k, v in kwargs.items()}
