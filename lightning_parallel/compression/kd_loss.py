"""The distillation loss: forward KL between softened teacher and student distributions over the vocabulary.

``T**2 * KL(softmax(t / T) || softmax(s / T))`` averaged over tokens (Hinton et al., 2015: the
``T**2`` keeps the gradient's scale as ``T`` changes). Three forms of logits:

- plain tensors ``(..., V)``: the whole vocabulary on every rank;
- DTensors sharded over the vocabulary (``Shard(-1)``, the tensor-parallel head under
  ``loss_parallel=True``): computed on the local shards as Megatron's vocabulary-parallel
  cross-entropy is. Each distribution's log-sum-exp takes the maximum and the sum of exponentials
  across the tensor-parallel ranks, and the per-token KL is summed across them: five all-reduces of
  one number per token, so the logits are never gathered. The gradient, ``(p_student -
  p_teacher) * T / tokens`` on each shard, needs no communication. (torch's ``loss_parallel()``
  handles only the log-softmax and is not re-entrant: the strategy's training step already runs
  inside it.)
- ``top_k``: only the teacher's ``k`` largest logits per token are kept (the rest of its
  distribution's mass dropped and renormalised), as when a large teacher's logits are stored
  or sent; the student's log-probabilities are still normalised over the whole vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["distillation_kl", "shard_like"]


def shard_like(full: Tensor, sharded: DTensor) -> DTensor:
    """``full`` (replicated logits) as a DTensor with ``sharded``'s vocabulary split: a local slice, no traffic."""
    replicated = DTensor.from_local(
        full, sharded.device_mesh, [Replicate()] * sharded.device_mesh.ndim, run_check=False
    )
    return replicated.redistribute(placements=sharded.placements)


def _on_vocabulary(placement: object, ndim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim in (-1, ndim - 1)


def _is_vocab_sharded(logits: Tensor) -> bool:
    return isinstance(logits, DTensor) and any(_on_vocabulary(p, logits.dim()) for p in logits.placements)


def distillation_kl(
    student: Tensor, teacher: Tensor, temperature: float = 1.0, top_k: int | None = None
) -> Tensor:
    """``T**2 * KL(teacher || student)`` per token, averaged; a plain scalar tensor, differentiable in ``student``.

    ``student`` and ``teacher``: logits of one shape ``(..., V)``, both plain or both sharded alike.
    """
    if student.shape != teacher.shape:
        raise ValueError(
            f"Student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ: the teacher"
            " must see the same tokens and share the student's vocabulary."
        )
    teacher = teacher.detach()
    if top_k is not None:
        if _is_vocab_sharded(student):
            raise ValueError(
                "`top_k` needs the whole vocabulary of a token on one rank; with `loss_parallel=True` the logits are"
                " sharded over it. Use top_k=None (the sharded KL), or loss_parallel=False."
            )
        return _top_k_kl(student, teacher, temperature, top_k)
    if _is_vocab_sharded(student):
        assert isinstance(student, DTensor)
        if not isinstance(teacher, DTensor):
            teacher = shard_like(teacher, student)
        mesh_dim = next(i for i, p in enumerate(student.placements) if _on_vocabulary(p, student.dim()))
        group = student.device_mesh.get_group(mesh_dim)
        return _ShardedKL.apply(student.to_local(), teacher.to_local(), temperature, group)
    return _kl(student, teacher, temperature)


def _kl(student: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    log_p_student = F.log_softmax(student.float() / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher.float() / temperature, dim=-1)
    per_token = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)
    return per_token.mean() * temperature**2


def _top_k_kl(student: Tensor, teacher: Tensor, temperature: float, k: int) -> Tensor:
    values, indices = teacher.float().topk(k, dim=-1)
    log_p_teacher = F.log_softmax(values / temperature, dim=-1)  # renormalised over the kept k
    log_p_student = F.log_softmax(student.float() / temperature, dim=-1).gather(-1, indices)
    per_token = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)
    return per_token.mean() * temperature**2


def _sharded_log_softmax(local: Tensor, group: ProcessGroup) -> Tensor:
    """``log_softmax`` over a vocabulary split across ``group``: the shift and the normaliser agreed by all-reduce."""
    shift = local.amax(-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    total = (local - shift).exp().sum(-1, keepdim=True)
    dist.all_reduce(total, group=group)
    return local - shift - total.log()


class _ShardedKL(torch.autograd.Function):
    """``T**2 * mean_tokens KL(teacher || student)`` from this rank's vocabulary shards; every rank returns the total."""

    @staticmethod
    def forward(
        ctx: Any, student: Tensor, teacher: Tensor, temperature: float, group: ProcessGroup
    ) -> Tensor:
        log_p_student = _sharded_log_softmax(student.float() / temperature, group)
        log_p_teacher = _sharded_log_softmax(teacher.float() / temperature, group)
        p_teacher = log_p_teacher.exp()
        per_token = (p_teacher * (log_p_teacher - log_p_student)).sum(-1)
        dist.all_reduce(per_token, group=group)
        tokens = per_token.numel()
        ctx.save_for_backward(log_p_student, p_teacher)
        ctx.scale, ctx.dtype = temperature / tokens, student.dtype
        return per_token.mean() * temperature**2

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        log_p_student, p_teacher = ctx.saved_tensors
        local = (log_p_student.exp() - p_teacher) * (grad * ctx.scale)
        return local.to(ctx.dtype), None, None, None
