"""Saved tensors kept by the strategy's hooks do not keep the graph alive after a zero-bubble backward.

torch's zero-bubble pipeline schedules split a micro-batch's backward in two (``torch.distributed.pipelining``'s
``stage_backward_input`` with ``retain_graph=True``, then ``stage_backward_weight`` below the weights only): the
nodes above the weights never run again. A pack hook that returns a saved tensor with its ``grad_fn`` makes the
graph reference itself through C++ (a node saving its own output), and those nodes then outlive the step; in a
two-rank ZB-V run every micro-batch's attention and activation-function tensors stayed alive until the end of
training, 40% of each micro-batch (``tests/planner/test_memory_exact.py`` measures the pipeline peak since).

One process, the recipe GPT and an unchanged Hugging Face Llama, through each way the strategy saves tensors:
the plain counter, the 16-bit-cast saver under autocast (and the gathered-input path it shares), the compressing
saver and the offloading saver. After the two backward halves and ``gc.collect()``, every saved storage is
freed (the counter's live bytes, which its finalizers decrement, are zero). Negative control: a pack hook that
keeps tensors as they are leaves bytes alive; the full backward (one pass) frees everything either way.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_parallel.memory.casts import CastSaver
from lightning_parallel.memory.counting import SavedTensorCounter, counting
from lightning_parallel.memory.saved_tensors import ActivationSaver, saved_tensors_context
from tests.models.families import build

BATCH, SEQ = 2, 32


def _blocks(family: str) -> torch.nn.Module:
    """The family's block stack's first block, as a pipeline stage after the first would hold it."""
    torch.manual_seed(0)
    model = build(family).model
    for name in ("transformer.h", "model.layers", "blocks", "h"):
        stack: Any = model
        try:
            for part in name.split("."):
                stack = getattr(stack, part)
        except AttributeError:
            continue
        return stack[0]
    raise AssertionError(f"no block stack found in {family}")


def _call(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if "Llama" in type(block).__name__:
        rotary = torch.ones(1, SEQ, block.self_attn.head_dim), torch.zeros(1, SEQ, block.self_attn.head_dim)
        out = block(hidden, position_embeddings=rotary)
    else:
        out = block(hidden)
    return out[0] if isinstance(out, tuple) else out


def _live_after(block: torch.nn.Module, hooks: Callable[[SavedTensorCounter], AbstractContextManager], *, split: bool
                ) -> tuple[int, int]:  # fmt: skip
    """(bytes saved by the forward, bytes still alive after the backward and a collection)."""
    counter = SavedTensorCounter.for_module(block)
    width = next(p for p in block.parameters() if p.dim() == 2).shape[-1]
    hidden = torch.randn(BATCH, SEQ, width, requires_grad=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    with hooks(counter), autocast:
        out = _call(block, hidden)
    saved = counter.bytes.peak
    grad = torch.randn_like(out)
    if split:  # as torch's zero-bubble schedules run a stage's backward
        _, groups = stage_backward_input([out], [grad], [hidden], block.parameters())
        stage_backward_weight(block.parameters(), groups)
        del groups
    else:
        out.backward(grad)
    del out, grad, hidden
    gc.collect()
    return saved, counter._live[0]


def _casts(counter: SavedTensorCounter) -> AbstractContextManager:
    return saved_tensors_context(None, counter, CastSaver())


def _saver(**kwargs: Any) -> Callable[[SavedTensorCounter], AbstractContextManager]:
    def enter(counter: SavedTensorCounter) -> AbstractContextManager:
        return saved_tensors_context(ActivationSaver(**kwargs), counter, CastSaver())

    return enter


@contextmanager
def _as_they_are(counter: SavedTensorCounter) -> Iterator[None]:
    """The hooks before the fix: the counter sees each tensor and keeps it as it is (with its grad_fn)."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not counter.is_parameter(tensor):
            counter.kept(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


HOOKS: dict[str, Callable[[SavedTensorCounter], AbstractContextManager]] = {
    "counter": counting,
    "casts": _casts,
    "bf16_compression": _saver(compression="bf16"),
    "offload": _saver(offload=True),
}


@pytest.mark.parametrize("family", ["recipe_gpt", "hf_llama"])
@pytest.mark.parametrize("hooks", list(HOOKS))
def test_a_zero_bubble_backward_frees_every_saved_tensor(family: str, hooks: str) -> None:
    block = _blocks(family)
    saved, alive = _live_after(block, HOOKS[hooks], split=True)
    assert saved > 0  # the hooks saw the forward's tensors
    assert alive == 0, (family, hooks, alive, saved)


@pytest.mark.parametrize("family", ["recipe_gpt", "hf_llama"])
def test_tensors_kept_with_their_history_outlive_the_split_backward(family: str) -> None:
    block = _blocks(family)
    saved, leaked = _live_after(block, _as_they_are, split=True)
    assert leaked > 0.2 * saved, (saved, leaked)  # the attention's and the activation's tensors, at least
    _, after_full = _live_after(block, _as_they_are, split=False)
    assert after_full == 0  # one backward pass runs every node and releases the cycle
