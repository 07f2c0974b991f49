"""The vocabulary-parallel cross-entropy, for unchanged training steps, without being asked.

A column-parallel output head holds ``V / tp`` of the vocabulary on each tensor-parallel rank. Gathering
its logits lets any user code read them, but ``F.cross_entropy`` then keeps fp32 log-probabilities over
the *whole* vocabulary on every rank until backward (Llama-3-70B at 16 x 8192 tokens a rank: 62.6 GiB).
Megatron and torchtitan keep the logits sharded and compute the loss on the shards.

This does the same for the step the user wrote. During a training step the head returns its logits as
a DTensor sharded over the vocabulary, and :class:`ShardedLogitsMode` (a ``TorchFunctionMode``) follows
them through the user's code:

- ``F.cross_entropy`` on them (class indices, no class weights) runs :func:`vocab_parallel_cross_entropy`
  on the local shards: three all-reduces of one number per token, and only the rank's ``V / tp`` logits
  (in their own dtype) and one fp32 log-sum-exp per token kept for backward;
- reshaping, slicing outside the vocabulary dimension, ``float()``/``to(dtype)``, ``detach()`` and metadata
  (``size``, ``shape``, ``dtype``) keep them sharded;
- anything else (``argmax`` for an accuracy, ``softmax`` for a distillation, arithmetic) receives them
  gathered, exactly as without this, and a line says once which function needed that.

So a step that only computes the loss never holds the whole vocabulary, and any other step still runs.
``loss_parallel=False`` turns this off (logits gathered as before); ``loss_parallel=True`` is the older
opt-in (torch's ``loss_parallel()`` context, the logits a DTensor for the whole step).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import tree_map
from lightning_parallel.tensor_parallel.regions import basic_index, flat_arguments

__all__ = ["ShardedLogitsMode", "vocab_parallel_cross_entropy"]

# Functions that keep the vocabulary dimension where it is (the last), or read only metadata.
_KEEPS_SHARDS = {
    "view",
    "reshape",
    "flatten",
    "contiguous",
    "float",
    "to",
    "type",
    "bfloat16",
    "half",
    "double",
    "detach",
    "__getitem__",
    "view_as",
    "reshape_as",
    "clone",
    "requires_grad_",
    "retain_grad",
}
_METADATA = {
    "size",
    "dim",
    "numel",
    "ndimension",
    "__get__",
    "__len__",
    "stride",
    "is_contiguous",
    "element_size",
    "is_floating_point",
    "get_device",
    "nelement",
}
# Hooks on the logits themselves: FSDP2 registers its pre-backward hook on a module's outputs, and a hook put
# on a gathered copy would never run (the loss on the shards does not reach it): ZeRO-3 then meets freed
# weights in the head's backward.
_HOOKS = {"register_hook", "register_post_accumulate_grad_hook"}


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits sharded over the vocabulary (the last dim), with label smoothing."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        vocab_size: int,
        group: dist.ProcessGroup,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        x = logits.float()
        top = x.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sum_exp = torch.exp(x - top.unsqueeze(-1)).sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        lse = top + torch.log(sum_exp)
        local = target - vocab_start
        mine = (local >= 0) & (local < x.shape[-1]) & (target != ignore_index)
        picked = torch.where(
            mine, x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1), 0.0
        )
        dist.all_reduce(picked, group=group)
        loss = lse - picked
        if smoothing:
            mean = x.sum(dim=-1)
            dist.all_reduce(mean, group=group)
            loss = (1.0 - smoothing) * loss + smoothing * (lse - mean / vocab_size)
        valid = target != ignore_index
        ctx.save_for_backward(logits, local, mine, valid, lse)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        return torch.where(valid, loss, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, local, mine, valid, lse = ctx.saved_tensors
        probabilities = torch.exp(logits.float() - lse.unsqueeze(-1))
        if ctx.smoothing:
            probabilities = probabilities - ctx.smoothing / ctx.vocab_size
        hit = (1.0 - ctx.smoothing) * mine.to(probabilities.dtype)
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        probabilities.scatter_add_(-1, index, -hit.unsqueeze(-1))
        scale = torch.where(valid, grad, 0.0).unsqueeze(-1)
        return (probabilities * scale).to(logits.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(logits, target)`` for ``(N, V)`` logits sharded over ``V`` on a 1-D mesh; a plain
    tensor, the same on every rank of the mesh."""
    mesh = logits.device_mesh
    vocab = logits.shape[-1]
    step = -(-vocab // mesh.size())  # Shard(-1) splits like torch.chunk
    per_token = _VocabParallelCrossEntropy.apply(
        logits.to_local(),
        target,
        mesh.get_local_rank() * step,
        vocab,
        mesh.get_group(),
        ignore_index,
        label_smoothing,
    )
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (target != ignore_index).sum()


def _sharded_on_last(tensor: Any) -> bool:
    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and isinstance(tensor.placements[0], Shard)
        and tensor.placements[0].dim in (-1, tensor.dim() - 1)
    )


class ShardedLogitsMode(TorchFunctionMode):
    """Follows the head's vocabulary-sharded logits through one training step (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._tracked: dict[int, weakref.ref] = {}
        self.sharded_losses = 0
        """``F.cross_entropy`` calls computed on the shards (this step)."""
        self.gathered: set[str] = set()
        """Functions that received the logits gathered (this step)."""
        self._told: set[str] = set()

    def track(self, logits: DTensor) -> DTensor:
        """The head's output, to follow (its forward hook calls this)."""
        key = id(logits)
        self._tracked[key] = weakref.ref(logits, lambda _: self._tracked.pop(key, None))
        return logits

    def start_step(self) -> None:
        self._tracked.clear()
        self.sharded_losses = 0
        self.gathered = set()

    def _is_tracked(self, value: Any) -> bool:
        ref = self._tracked.get(id(value)) if isinstance(value, DTensor) else None
        return ref is not None and ref() is value

    def _any_tracked(self, values: Iterator[Any]) -> bool:
        return any(self._is_tracked(v) for v in values)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._tracked or not self._any_tracked(flat_arguments(args, kwargs)):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func is F.cross_entropy:
            loss = self._cross_entropy(*args, **kwargs)
            if loss is not None:
                self.sharded_losses += 1
                return loss
        elif (
            name in _METADATA
            or name in _HOOKS
            or (name in _KEEPS_SHARDS and not _cuts_vocabulary(name, args))
        ):
            out = func(*args, **kwargs)
            if not isinstance(out, DTensor):
                return out
            return self.track(out) if _sharded_on_last(out) else out.full_tensor()
        self._tell(name or repr(func))
        return func(*tree_map(self._gather, args), **tree_map(self._gather, kwargs))

    def _gather(self, value: Any) -> Any:
        if not self._is_tracked(value):
            return value
        return value.redistribute(placements=[Replicate()]).to_local()

    def _cross_entropy(
        self,
        input: Any,
        target: torch.Tensor,
        weight: Any = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor | None:
        """The sharded loss, or None where it does not apply (the caller then gathers)."""
        usable = (
            self._is_tracked(input)
            and _sharded_on_last(input)
            and input.dim() == 2
            and weight is None
            and size_average is None
            and reduce is None
            and isinstance(target, torch.Tensor)
            and not isinstance(target, DTensor)
            and not target.is_floating_point()
            and reduction in ("mean", "sum", "none")
        )
        if not usable:
            return None
        return vocab_parallel_cross_entropy(input, target, ignore_index, reduction, label_smoothing)

    def _tell(self, name: str) -> None:
        self.gathered.add(name)
        if name not in self._told:
            self._told.add(name)
            rank_zero_info(
                f"loss_parallel: the training step passed the output head's logits to `{name}`, which receives"
                " them gathered over the vocabulary (batch x sequence x vocabulary on every tensor-parallel"
                " rank); F.cross_entropy still runs on the shards."
            )


def _cuts_vocabulary(name: str, args: tuple) -> bool:
    """Indexing that may cut the vocabulary (or that DTensor may not shard): it gets the gathered logits.
    Kept sharded: integers, slices and ``...`` that leave the last dimension whole (``logits[:, :-1]``)."""
    if name != "__getitem__" or len(args) < 2:
        return False
    expanded = basic_index(args[1], args[0].dim())
    return expanded is None or (bool(expanded) and expanded[-1] != slice(None))
