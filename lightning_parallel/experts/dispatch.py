"""Moving tokens to their experts and back: the only file of ``experts`` that communicates.

Without an expert-parallel group, dispatch is a sort: (token, choice) assignments are ordered by
expert, the experts run on the sorted rows, and the results are put back in assignment order.

With an expert-parallel group of P ranks, experts are sharded contiguously: rank d holds
experts ``[d * L, (d + 1) * L)`` with ``L = E / P``. Then, for each MoE layer:

1. the counts per expert are exchanged (one ``all_to_all_single`` of E integers), so that every
   rank knows how many rows it will receive from each peer for each of its experts;
2. the rows (sorted by expert, hence by destination rank) travel with ``all_to_all_single`` and
   uneven split sizes; they arrive ordered (source rank, local expert) and are regrouped to
   (local expert, source rank) for the grouped matmuls;
3. the local experts run; the results go back by the reverse permutation and the reverse
   all-to-all.

Both all-to-alls are differentiable (:class:`_AllToAll`): the backward of each is the other
direction's all-to-all of the gradients. Every rank of the group must run every MoE layer the
same number of times, in the same order (true of data-parallel replicas running one model).

Uneven splits use ``all_to_all_single`` because the list form ``dist.all_to_all`` fails on gloo
with uneven sizes (observed with torch 2.13).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_parallel.experts.router import count_values

ProcessGroup = dist.ProcessGroup
ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse all-to-all.

    Our own rather than ``torch.distributed.nn.functional.all_to_all_single``, which torch 2.13
    deprecates (a warning per call) in favour of functional collectives that lack gloo's
    uneven-split support on CPU.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Send ``input_splits[d]`` rows of ``x`` to rank d; receive ``output_splits[s]`` from rank s."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def gather_counts(counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``counts`` (same shape everywhere), stacked: ``(R, *counts.shape)``."""
    gathered = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, counts.contiguous(), group=group)
    return torch.stack(gathered)


def sum_over_group(value: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce sum (no gradient): routing statistics of the whole token group."""
    if group is None:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, group=group)
    return value


def report_group_mean(share: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``share`` with the value of its mean over ``group`` and its own gradient.

    An auxiliary loss over a token group is a share on each rank (its tokens' router
    probabilities against the global counts; the shares' mean is the global loss). Reported as
    the mean, ranks that hold one batch (context parallel) report one loss, the global one,
    while each still back-propagates exactly its part.
    """
    if group_size(group) == 1:
        return share
    mean = sum_over_group(share.float(), group) / group_size(group)
    return share + (mean.to(share.dtype) - share).detach()


def sum_in_place(tensors: list[torch.Tensor], group: ProcessGroup | None) -> None:
    """All-reduce sum of ``tensors`` over ``group``, coalesced into one collective, in place."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        tensor.copy_(reduced.view_as(tensor))


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _expert_parallel(
    x_MH: torch.Tensor, counts_E: torch.Tensor, compute: ExpertFn, group: ProcessGroup
) -> torch.Tensor:
    """Rows sorted by global expert -> owners -> local experts -> back, in the same row order."""
    num_ranks = dist.get_world_size(group)
    num_local = counts_E.numel() // num_ranks
    # 1. counts: received[s, l] = rows that source s sends to my local expert l
    received_SL = torch.empty_like(counts_E)
    dist.all_to_all_single(received_SL, counts_E.contiguous(), group=group)
    received_SL = received_SL.view(num_ranks, num_local)
    # The one host read of the exchange: the split sizes all_to_all_single takes as numbers.
    send_splits, recv_splits = torch.stack(
        [counts_E.view(num_ranks, num_local).sum(1), received_SL.sum(1)]
    ).tolist()
    # 2. rows to their owners; regroup (source, expert) -> (expert, source)
    recv_RH = all_to_all(x_MH, recv_splits, send_splits, group)
    chunk_R = torch.repeat_interleave(
        torch.arange(num_ranks * num_local, device=x_MH.device),
        received_SL.reshape(-1),
        output_size=sum(recv_splits),
    )
    source_R, local_R = chunk_R // num_local, chunk_R % num_local
    by_expert_R = torch.argsort(local_R * num_ranks + source_R, stable=True)
    # 3. local experts, then back in the received order and to the sources
    y_RH = compute(recv_RH[by_expert_R], received_SL.sum(0))
    y_RH = y_RH[_inverse(by_expert_R)]
    return all_to_all(y_RH, send_splits, recv_splits, group)


def dispatch(
    x_NH: torch.Tensor,
    token_A: torch.Tensor,
    expert_A: torch.Tensor,
    num_experts: int,
    compute: ExpertFn,
    ep_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Expert outputs ``(A, H)`` for assignments ``A`` (token ``token_A[a]`` to expert ``expert_A[a]``).

    ``compute(x_MH, counts_L)`` runs the experts held by this rank on rows grouped by expert, in
    expert order (``counts_L[l]`` rows for local expert l). ``num_experts`` is the global count;
    with ``ep_group`` this rank holds ``num_experts / ep_size`` of them (``ExpertParallel``).
    """
    order_A = torch.argsort(expert_A, stable=True)
    counts_E = count_values(expert_A, num_experts)
    x_MH = x_NH[token_A[order_A]]
    if group_size(ep_group) == 1:
        y_MH = compute(x_MH, counts_E)
    else:
        assert ep_group is not None
        y_MH = _expert_parallel(x_MH, counts_E, compute, ep_group)
    return y_MH[_inverse(order_A)]
