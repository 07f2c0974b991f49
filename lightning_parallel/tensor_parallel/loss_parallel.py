"""Vocabulary-parallel loss for unchanged training steps: the head's hook, and the opt-in ``loss_parallel=True``.

By default the output head gathers its logits so that any user code can read them, at the
cost of one all-gather of ``batch x sequence x vocabulary`` values per step. Megatron instead
keeps the logits sharded over the vocabulary and computes the cross-entropy with three small
all-reduces. torch offers the same through ``loss_parallel()``, which makes
``F.cross_entropy`` accept logits sharded on their last dimension, forward and backward.

With ``loss_parallel=True`` the strategy runs the user's ``training_step`` inside that
context with the head's logits left sharded (a DTensor), and its ``backward`` too; anything
the step returns or logs is turned back into plain tensors. Outside the training step
(validation, prediction) the head gathers its logits as usual, so metrics see plain tensors.
The training step must only reshape the logits and pass them to ``F.cross_entropy``; other
uses of the logits inside it fail with DTensor's error, which is why this is opt-in.

The default (``loss_parallel=None``) needs no such promise: the head returns its sharded logits to
:class:`~lightning_parallel.tensor_parallel.vocab_loss.ShardedLogitsMode`, which computes
``F.cross_entropy`` on the shards and gathers the logits for any other use (``vocab_loss.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.hooks import RemovableHandle

from lightning_parallel.compat import tree_map
from lightning_parallel.tensor_parallel.styles import ColwiseProjection
from lightning_parallel.tensor_parallel.vocab_loss import ShardedLogitsMode


@dataclass
class LossParallelState:
    """Whether the current forward belongs to a training step run with a sharded loss; ``mode``: the
    default's follower of the sharded logits (None under ``loss_parallel=True``)."""

    active: bool = False
    mode: ShardedLogitsMode | None = None


def sharded_head_style() -> ColwiseProjection:
    return ColwiseProjection(output_layouts=Shard(-1), use_local_output=False)


def install_head_hook(head: nn.Module, state: LossParallelState) -> RemovableHandle:
    """Outside the sharded training step, gather the logits into a plain tensor."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, DTensor):
            return None
        if state.active:
            return state.mode.track(output) if state.mode is not None else None
        return output.redistribute(placements=[Replicate()]).to_local()

    return head.register_forward_hook(hook)


def to_plain(value: Any) -> Any:
    """DTensors (replicated results of the sharded loss) as plain local tensors, differentiably."""

    def convert(item: Any) -> Any:
        if isinstance(item, DTensor):
            return item.redistribute(placements=[Replicate()] * item.device_mesh.ndim).to_local()
        return item

    return tree_map(convert, value)


@contextmanager
def sharded_loss_step(module: nn.Module, state: LossParallelState) -> Iterator[None]:
    """Run a training step with sharded logits; ``self.log`` receives plain tensors."""
    original_log, original_log_dict = module.log, module.log_dict

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        original_log(name, to_plain(value), *args, **kwargs)

    def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        original_log_dict(to_plain(dictionary), *args, **kwargs)

    module.log, module.log_dict = log, log_dict
    state.active = True
    try:
        with loss_parallel():
            yield
    finally:
        state.active = False
        del module.log, module.log_dict


@contextmanager
def followed_logits(state: LossParallelState) -> Iterator[None]:
    """A training step (under pipelines: a whole schedule) whose head logits ``state.mode`` follows."""
    assert state.mode is not None
    state.mode.start_step()
    state.active = True
    try:
        with state.mode:
            yield
    finally:
        state.active = False


@contextmanager
def sharded_loss_backward() -> Iterator[None]:
    with loss_parallel():
        yield
