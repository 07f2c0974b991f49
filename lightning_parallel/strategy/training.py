"""The strategy's training step and backward: what the step holds for backward, and where its loss is computed.

``HybridParallelStrategy.training_step`` and ``backward`` call these. Around the user's step (under pipeline
stages: around the whole schedule, whose backward runs inside it):

- one pair of saved-tensor hooks (``memory/saved_tensors.py``): activation offload and compression, the
  counter of :class:`~lightning_parallel.memory.monitor.ActivationMemoryMonitor`, and under ``*-mixed``
  precision the 16-bit casts kept once or not at all (``memory/casts.py``: no 16-bit copy of a weight
  outlives its op, one copy of an activation for all the projections reading it), and under tensor
  parallelism the inputs the forward gathered over tp kept as this rank's slice (``memory/regather.py``);
- the vocabulary-parallel loss: by default ``F.cross_entropy`` on the logits of a sharded head runs on the
  shards (``tensor_parallel/vocab_loss.py``); with ``loss_parallel=True`` torch's ``loss_parallel()``;
- under context parallelism, the follower of each rank's tokens after the last block (the head and the loss
  on them: ``context_parallel/local_tokens.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_parallel.memory.casts import CastSaver
from lightning_parallel.memory.saved_tensors import saved_tensors_context
from lightning_parallel.parallelize import Parallelized
from lightning_parallel.strategy import pipelined
from lightning_parallel.tensor_parallel.loss_parallel import (
    followed_logits,
    sharded_loss_backward,
    sharded_loss_step,
    to_plain,
)

__all__ = ["autocasts", "backward", "training_step"]


def autocasts(plugin: Precision) -> bool:
    """Whether the precision plugin runs the step under autocast (``*-mixed``, fp8, ZeRO's autocast)."""
    if isinstance(plugin, MixedPrecision):
        return True
    return str(getattr(plugin, "precision", "")).endswith("-mixed")


@contextmanager
def _step_memory(strategy: Any, p: Parallelized) -> Iterator[None]:
    saver = p.activation_saver if strategy.config.memory.saves_tensors else None
    with ExitStack() as stack:
        stack.enter_context(
            saved_tensors_context(saver, strategy.activation_counter, strategy.casts, strategy.regather)
        )
        if p.loss_state.mode is not None:
            stack.enter_context(followed_logits(p.loss_state))
        if p.context_tokens is not None:  # inside the vocabulary's follower: sees the step's calls first
            stack.enter_context(p.context_tokens)
        yield


def training_step(
    strategy: Any, p: Parallelized, lightning_step: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """The user's step (``lightning_step``: Lightning's ``Strategy.training_step``), or the pipelined one."""
    scaler = getattr(strategy.precision_plugin, "scaler", None)
    aux = p.experts.aux_losses
    module = strategy.lightning_module
    with _step_memory(strategy, p):
        if p.pipeline is not None:
            return pipelined.training_step(
                p.pipeline,
                module,
                scaler,
                aux,
                strategy.precision_plugin.train_step_context,
                args,
                kwargs,
                final=not strategy._sync_blocked,
                batch_idx=strategy._batch_idx,
            )
        if aux is not None:
            aux.start_step(pipelined.loss_scale(module, scaler, micro_batches=1))
        if not p.loss_parallel:
            output = lightning_step(*args, **kwargs)
        else:
            with sharded_loss_step(module, p.loss_state):
                output = to_plain(lightning_step(*args, **kwargs))
        if p.context_tokens is not None:  # tensors the step returns, whole, as one process returns them
            output = p.context_tokens.whole_values(output)
        return aux.with_injected(output) if aux is not None else output


def backward(
    strategy: Any,
    p: Parallelized,
    lightning_backward: Callable[..., torch.Tensor],
    closure_loss: torch.Tensor,
    args: tuple,
    kwargs: dict,
) -> torch.Tensor:
    """Lightning's backward (``lightning_backward``), or under pipelines its hooks around the held gradients."""
    module = strategy.lightning_module
    if p.pipeline is not None:  # the schedule already ran backward: Lightning's hooks around its gradients
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        p.pipeline.add_held_gradients()
        if not strategy._sync_blocked:
            p.gradients.reduce()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss
    if not strategy._sync_blocked:
        p.gradients.begin_final_backward()  # the explicit reductions launch their buckets during it
    if not p.loss_parallel:
        result = lightning_backward(closure_loss, *args, **kwargs)
    else:
        with sharded_loss_backward():
            result = lightning_backward(closure_loss, *args, **kwargs)
    if not strategy._sync_blocked:
        p.gradients.reduce()  # the explicit reductions (experts; under ZeRO the part before its step)
    return result


def cast_saver(plugin: Precision) -> CastSaver | None:
    """The casts' part of the saved-tensor hooks, for a precision that autocasts (else None: nothing to do)."""
    return CastSaver() if autocasts(plugin) else None
