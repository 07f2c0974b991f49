"""Memory of every distinct rank of a layout: parameters, gradients, optimizer states, activations, buffers.

Computed from the unchanged module (on the meta device) and a :class:`~.layout.Layout`, without
processes, by the rules the strategy applies at setup: which parameters each pipeline stage holds
(``pipeline/stages.py``: blocks by the balanced cut, what precedes the first block on stage 0, what
follows the last on the last stage, a tied head on both), what each tensor-parallel rank keeps of a
weight (the plan's styles, ``plans/auto.py``, split like ``torch.chunk``), experts split over ``ep``,
and where ZeRO's engine puts the rest (``zero/engine_choice.py: engine_for``): torch's FSDP2 shards every
tensor on its first dimension over ``dp``, DeepSpeed flattens them into one padded partition per rank.

Unlike Megatron's and DeepSpeed's estimators, which report the most loaded rank, every distinct rank
is reported: each pipeline stage (first and last with embeddings and head), each tensor-parallel rank
whose shards differ, and the spread of ZeRO's partitions over the data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from torch import nn

from lightning_parallel.config.arguments import resolve_schedule
from lightning_parallel.data_parallel.buckets import BUCKET_BYTES
from lightning_parallel.pipeline.receive_buffers import buffers_in_flight
from lightning_parallel.planner.activations import held_at_peak, stage_activation_bytes
from lightning_parallel.planner.host_updates import deferred_update_bytes
from lightning_parallel.planner.layout import (
    PRECISIONS,
    Layout,
    gathered_parameter_bytes,
    layout_problems,
    zero_engine,
)
from lightning_parallel.planner.placement import fsdp_local_elements, parameter_placements, stage_split
from lightning_parallel.planner.shapes import ModelShape, describe
from lightning_parallel.zero.arguments import BUCKET_ELEMENTS

__all__ = ["RankMemory", "rank_memory"]

_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "adafactor": 0}
_DEEPSPEED_ALIGNMENT = (
    2  # DeepSpeed pads each flat group to a multiple of 2 x dp elements (nccl_start_alignment_factor)
)


@dataclass
class RankMemory:
    """Bytes one rank holds. ``*_host``: in host memory (offload); ``nvme``: in files of ``offload_path``."""

    label: str
    pp_rank: int
    tp_rank: int
    dp_rank: int
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    """Held for backward at the schedule's peak: each of this rank's stages' micro-batch bytes times the
    micro-batches it holds then (``planner/activations.py: held_at_peak``), plus one block's recomputation
    under checkpointing."""
    activations_per_micro_batch: int = 0
    in_flight: int = 1
    """The most micro-batches one of this rank's stages holds at the peak (all of them on one stage)."""
    buffers: int = 0
    parameters_host: int = 0
    gradients_host: int = 0
    optimizer_host: int = 0
    activations_host: int = 0
    """Activations waiting in host memory at the schedule's peak (``activation_offload``)."""
    activations_host_per_micro_batch: int = 0
    """Held in host memory by one micro-batch's forward, summed over this rank's stages."""
    update_host: int = 0
    """What a deferred host update holds beside the offloaded states (``offload_update`` other than ``"exact"``:
    :func:`deferred_update_bytes`)."""
    nvme: int = 0
    elements: int = 0
    """Parameter elements this rank holds (after every split)."""
    notes: list[str] = field(default_factory=list)

    @property
    def states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def device_total(self) -> int:
        return self.states + self.activations + self.buffers

    @property
    def host_total(self) -> int:
        return (
            self.parameters_host
            + self.gradients_host
            + self.optimizer_host
            + self.update_host
            + self.activations_host
        )

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(device_total=self.device_total, host_total=self.host_total)
        return out


def rank_memory(
    model: nn.Module,
    layout: Layout,
    shape: ModelShape | None = None,
    *,
    distinct: bool = True,
    cache: dict | None = None,
) -> list[RankMemory]:
    """One entry per (pipeline rank, tensor-parallel rank) and, under ZeRO, data-parallel rank; with
    ``distinct``, ranks with equal numbers folded into one (its ``notes`` name the others).

    Over more than 8 data-parallel ranks only the first and the last are computed (ZeRO's partitions
    split like ``torch.chunk``: the first holds the most, the last the least). ``cache``: a dict kept
    across calls for one model (a search), holding the stage cuts and the tensor-parallel splits.
    """
    shape = shape or describe(model)
    problems = layout_problems(layout, shape)
    if problems:
        raise ValueError(
            f"The layout {layout.short()} cannot exist for {shape.name}: " + "; ".join(problems) + "."
        )
    cache = {} if cache is None else cache
    split_key = (layout.pipeline_parallel, layout.pipeline_schedule, layout.pipeline_virtual_stages)
    if split_key not in cache:
        cache[split_key] = stage_split(model, layout)
    stage_of, ranges, owners = cache[split_key]
    placement_key = (layout.tensor_parallel, layout.sequence_parallel, tuple(stage_of))
    if placement_key not in cache:
        cache[placement_key] = parameter_placements(model, layout, stage_of)
    placements = cache[placement_key]
    engine = zero_engine(layout)
    tp, dp, ep, pp = (
        layout.tensor_parallel,
        layout.data_parallel,
        layout.expert_parallel,
        layout.pipeline_parallel,
    )
    param_bytes, _, grad_bytes = PRECISIONS[layout.precision]
    dp_ranks = (range(dp) if dp <= 8 else [0, dp - 1]) if engine else range(1)
    out = []
    for pp_rank in range(pp):
        my_stages = {s for s, o in enumerate(owners) if o == pp_rank}
        for tp_rank in range(tp):
            local = [
                (p, math.prod(p.tp_local[tp_rank]) // (ep if p.expert else 1), p.tp_local[tp_rank])
                for p in placements
                if p.stages & my_stages
            ]
            for dp_rank in dp_ranks:
                out.append(
                    _one_rank(layout, engine, local, pp_rank, tp_rank, dp_rank, param_bytes, grad_bytes)
                )
            for rank in out[-len(dp_ranks) :]:
                _add_activations(rank, shape, layout, ranges, owners, pp_rank)
    return _distinct(out) if distinct else out


def _one_rank(
    layout: Layout,
    engine: str | None,
    local: list,
    pp_rank: int,
    tp_rank: int,
    dp_rank: int,
    param_bytes: int,
    grad_bytes: int,
) -> RankMemory:
    dp, stage, ep = layout.data_parallel, layout.zero_stage, layout.expert_parallel
    states = _OPTIMIZER_STATES.get(layout.optimizer, 2)
    elements = sum(n for _, n, _ in local)
    label = _label(layout, pp_rank, tp_rank, dp_rank, engine)
    rank = RankMemory(label, pp_rank, tp_rank, dp_rank, elements=elements)
    if engine is None:
        rank.parameters, rank.gradients = elements * param_bytes, elements * grad_bytes
        # torch's optimizers keep states in the weight's dtype
        rank.optimizer = elements * states * param_bytes
        if dp > 1:
            rank.buffers = min(BUCKET_BYTES, rank.gradients)
        return rank
    # every tensor split on a dim tensor parallelism leaves alone; experts over replicas
    if engine == "fsdp2":
        shard = sum(
            fsdp_local_elements(n, s, p.tp_dim, dp // ep, dp_rank // ep)
            if p.expert
            else fsdp_local_elements(n, s, p.tp_dim, dp, dp_rank)
            for p, n, s in local
        )
        rank.parameters, rank.gradients = shard * param_bytes, shard * grad_bytes
        rank.optimizer = shard * states * 4 + (shard * 4 if param_bytes < 4 else 0)
        gathered = gathered_parameter_bytes(layout) or param_bytes  # the unsharded copies
        # zero_reshard="step": the stage's whole weights and gradients (accumulated in fp32), all step
        if layout.pipeline_parallel > 1:
            rank.buffers = (elements - shard) * (gathered + grad_bytes)
        elif stage == 2:  # not resharded after forward (parallelize/gradients.py): whole weights to backward
            rank.buffers = (elements - shard) * gathered
        else:  # a gathered unit and the next one prefetched
            rank.buffers = 2 * max((n for _, n, _ in local), default=0) * gathered
        if layout.offload == "cpu" and layout.offload_update != "exact":
            matrices = [
                (n, s, fsdp_local_elements(n, s, p.tp_dim, dp, dp_rank)) for p, n, s in local if len(s) >= 2
            ]
            # the split refuses tp: dim 0 is sharded
            rows = sum(kept // (n // s[0]) for n, s, kept in matrices)
            rank.update_host = deferred_update_bytes(
                layout.offload_update,
                shard,
                sum(kept for *_, kept in matrices),
                rows,
                param_bytes,
                grad_bytes,
            )
    else:  # DeepSpeed: one flat partition per rank, padded, over the experts' replicas under ep (zero/groups.py)
        # DeepSpeed's fp16: half-precision weights and gradients, fp32 masters
        if layout.precision == "16-mixed":
            param_bytes = grad_bytes = 2
        replicas = dp // ep
        padded = math.ceil(elements / (_DEEPSPEED_ALIGNMENT * replicas)) * _DEEPSPEED_ALIGNMENT * replicas
        shard = padded // replicas
        rank.parameters = (shard if stage == 3 else elements) * param_bytes
        rank.gradients = (shard if stage >= 2 else elements) * grad_bytes
        rank.optimizer = shard * (states * 4 + 4)  # fp32 states and DeepSpeed's fp32 partition of the weights
        rank.buffers = min(elements, BUCKET_ELEMENTS) * grad_bytes if stage >= 2 else 0
    if layout.offload:
        _offload(rank, layout.offload, moves_weights=stage == 3 or engine == "fsdp2", fsdp2=engine == "fsdp2")
    return rank


def _offload(rank: RankMemory, where: str, *, moves_weights: bool, fsdp2: bool) -> None:
    """Optimizer states to the host (or NVMe); the sharded weights and gradients too where the engine moves them:
    DeepSpeed at stage 3, FSDP2's offload policy always (``zero/fsdp.py``)."""
    if where == "nvme":
        rank.nvme, rank.optimizer = rank.optimizer, 0
    else:
        rank.optimizer_host, rank.optimizer = rank.optimizer, 0
    if moves_weights:
        rank.parameters_host, rank.parameters = rank.parameters, 0
    if moves_weights and fsdp2:  # FSDP2 reduces the gradient shards onto the host too
        rank.gradients_host, rank.gradients = rank.gradients, 0


def _add_activations(
    rank: RankMemory, shape: ModelShape, layout: Layout, ranges: list[range], owners: list[int], pp_rank: int
) -> None:
    mine = [s for s, o in enumerate(owners) if o == pp_rank]
    last = len(ranges) - 1
    estimates = {
        s: stage_activation_bytes(shape, layout, ranges[s], first=s == 0, last=s == last) for s in mine
    }
    held = held_at_peak(layout, pp_rank, {s: e.per_micro_batch for s, e in estimates.items()})
    total = sum(e.per_micro_batch * held[s] for s, e in estimates.items())
    rank.activations_host = int(sum(e.host_per_micro_batch * held[s] for s, e in estimates.items()))
    rank.activations_host_per_micro_batch = int(sum(e.host_per_micro_batch for e in estimates.values()))
    total += estimates[mine[0]].recompute_working_set if mine else 0
    per_micro_batch = sum(e.per_micro_batch for e in estimates.values())
    rank.in_flight = max(held.values(), default=1)
    rank.activations, rank.activations_per_micro_batch = int(total), int(per_micro_batch)
    if layout.pipeline_parallel > 1:
        rank.buffers += int(_receive_buffers(shape, layout, mine, last))


def _receive_buffers(shape: ModelShape, layout: Layout, stages: list[int], last: int) -> float:
    """Pipeline receive buffers (``pipeline/receive_buffers.py``): as many per stage as the schedule has
    receives outstanding or micro-batches in flight there (counted on torch's own schedule), each one
    micro-batch's hidden state (the activations a stage after the first receives, the gradients one before
    the last receives)."""
    act = PRECISIONS[layout.precision][1]
    residual = 4 if layout.precision.endswith("-mixed") else act  # autocast leaves the residual stream fp32
    sp = layout.tensor_parallel if layout.sequence_parallel else 1
    one = layout.local_tokens * shape.hidden * residual / sp
    held = buffers_in_flight(
        resolve_schedule(layout.pipeline_schedule),
        layout.pipeline_parallel,
        layout.pipeline_virtual_stages,
        layout.micro_batches,
    )
    return sum(held[s] * one for s in stages)


def _label(layout: Layout, pp_rank: int, tp_rank: int, dp_rank: int, engine: str | None) -> str:
    parts = []
    if layout.pipeline_parallel > 1:
        parts.append(f"pp rank {pp_rank}")
    if layout.tensor_parallel > 1:
        parts.append(f"tp rank {tp_rank}")
    if engine:
        parts.append(f"dp rank {dp_rank}")
    return ", ".join(parts) or "every rank"


def _distinct(ranks: list[RankMemory]) -> list[RankMemory]:
    """Ranks whose numbers differ; equal ones folded into the first (its label says which it stands for)."""
    kept: list[RankMemory] = []
    for rank in ranks:
        key = (
            rank.pp_rank,
            rank.parameters,
            rank.gradients,
            rank.optimizer,
            rank.activations,
            rank.buffers,
            rank.host_total,
            rank.nvme,
        )
        twin = next(
            (
                k
                for k in kept
                if (
                    k.pp_rank,
                    k.parameters,
                    k.gradients,
                    k.optimizer,
                    k.activations,
                    k.buffers,
                    k.host_total,
                    k.nvme,
                )
                == key
            ),
            None,
        )
        if twin is None:
            kept.append(rank)
        else:
            twin.notes.append(rank.label)
    return kept
