"""The fastest layouts that fit: every layout of a model on a number of devices, predicted and ranked.

For each tensor-parallel degree inside a node, each pipeline degree, each expert-parallel degree
and the data-parallel degree that fills the devices, the search tries the options the strategy
offers (ZeRO stage, activation checkpointing, micro-batch size and count for the global batch,
1F1B or interleaved stages) and keeps those whose every rank fits the device's memory. They are
ranked by predicted tokens per second. A family of degrees with no layout left says why: the degree
does not divide the heads, or the best option of the family is still out of memory on a named rank.

What the search does not try: sequence parallelism off under tensor parallelism (on costs no time
and saves memory; off only for models with routed experts, which it does not compose with), offload
(slower whenever a layout fits without it), the zero-bubble schedules.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from torch import nn

from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.layout import Layout, layout_problems
from lightning_parallel.planner.memory import RankMemory, rank_memory
from lightning_parallel.planner.shapes import ModelShape, describe
from lightning_parallel.planner.timing import StepTime, step_time

__all__ = ["Candidate", "SearchResult", "search"]

USABLE_MEMORY = 0.9  # of the device's memory: the rest goes to the allocator's fragmentation, CUDA's context


@dataclass
class Candidate:
    """A layout with its predicted memory per rank and step time."""

    layout: Layout
    ranks: list[RankMemory]
    time: StepTime

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.device_total)


@dataclass
class SearchResult:
    fastest: list[Candidate]
    """Layouts that fit, fastest first."""
    rejected: dict[str, str] = field(default_factory=dict)
    """A family of degrees (``tp2 pp4 ep1``) with no layout that fits -> why."""
    tried: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_MIN_CONTEXT_SHARD = 4096
"""Tokens of each sequence a context-parallel rank must keep for the search to try it: below that the ring's
exchanges outweigh the attention they hide behind, and the memory it saves is small."""


def _context_degrees(dp: int, sequence_length: int) -> list[int]:
    """The context-parallel degrees the search tries: 1, and divisors of ``dp`` up to a node (8) that leave each rank
    at least :data:`_MIN_CONTEXT_SHARD` tokens in whole ring chunks."""
    return [1] + [
        c
        for c in _divisors(dp)
        if 1 < c <= 8 and sequence_length % (2 * c) == 0 and sequence_length // c >= _MIN_CONTEXT_SHARD
    ]


def _batches(
    dp: int, pp: int, global_batch: int | None, per_replica: int | None, micro_batch_sizes: tuple[int, ...]
) -> Iterator[tuple[int, int]]:
    """(micro-batch size, micro-batches per step) a replica can run: for a global batch (accumulating
    without stages), or for a fixed batch per replica (one DataLoader batch per step)."""
    if per_replica is not None:
        if pp == 1:
            yield per_replica, 1
            return
        for mbs in micro_batch_sizes:
            if per_replica % mbs == 0:
                yield mbs, per_replica // mbs
        return
    assert global_batch is not None
    for mbs in micro_batch_sizes:
        if global_batch % (dp * mbs) == 0:
            yield mbs, global_batch // (dp * mbs)


# Recomputation the search tries, least recomputed first: none, selective ("ops", then every second
# projection matmul too), full.
_CHECKPOINTING = (
    (None, "ops"),
    ("selective", "ops"),
    ("selective", "ops_alternate_matmuls"),
    ("full", "ops"),
)


def _options(base: Layout, shape: ModelShape, batches: Iterator[tuple[int, int]]) -> Iterator[Layout]:
    """Every option the search tries for one family of degrees."""
    dp, pp = base.data_parallel, base.pipeline_parallel
    for mbs, micro_batches in batches:
        schedules = [("1f1b", 1)]
        if pp > 1 and micro_batches % pp == 0 and shape.num_layers % (2 * pp) == 0:
            schedules.append(("interleaved_1f1b", 2))
        for schedule, virtual in schedules:
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                for checkpointing, policy in _CHECKPOINTING:
                    yield replace(
                        base,
                        micro_batch_size=mbs,
                        micro_batches=micro_batches,
                        pipeline_schedule=schedule,
                        pipeline_virtual_stages=virtual,
                        zero_stage=zero,
                        activation_checkpointing=checkpointing,
                        activation_checkpointing_policy=policy,
                    )


def search(
    model: nn.Module,
    gpus: int,
    cluster: Cluster,
    global_batch: int | None,
    sequence_length: int,
    precision: str = "bf16-mixed",
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
    top: int = 10,
    shape: ModelShape | None = None,
    per_replica_batch: int | None = None,
) -> SearchResult:
    """The ``top`` fastest layouts of ``model`` on ``gpus`` devices of ``cluster`` that fit, and why the rest do not.

    ``global_batch`` sequences of ``sequence_length`` tokens per optimizer step, over all replicas
    (without pipeline stages, micro-batches beyond one are gradient accumulation); or, instead,
    ``per_replica_batch``: the DataLoader's batch, one per step on every replica, whatever their number.
    """
    if (global_batch is None) == (per_replica_batch is None):
        raise ValueError("Give the search one of `global_batch` and `per_replica_batch`.")
    if gpus < 1 or (global_batch or per_replica_batch or 0) < 1:
        raise ValueError(
            f"`gpus={gpus}` and the batch ({global_batch or per_replica_batch}) must be positive."
        )
    shape = shape or describe(model)
    budget = USABLE_MEMORY * cluster.memory_bytes
    experts = max((b.num_experts for b in shape.blocks), default=0)
    result = SearchResult([])
    cache: dict = {}
    fits: list[Candidate] = []
    for tp in [d for d in _divisors(gpus) if d <= cluster.gpus_per_node]:
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            for ep, cp in [
                (e, c)
                for e in ([e for e in _divisors(dp) if experts and experts % e == 0] or [1])
                for c in _context_degrees(dp, sequence_length)
            ]:
                family = (
                    f"tp{tp} pp{pp} dp{dp}" + (f" ep{ep}" if experts else "") + (f" cp{cp}" if cp > 1 else "")
                )
                base = Layout(
                    tensor_parallel=tp,
                    sequence_parallel=tp > 1 and not experts,
                    pipeline_parallel=pp,
                    data_parallel=dp,
                    expert_parallel=ep,
                    context_parallel=cp,
                    precision=precision,
                    sequence_length=sequence_length,
                    micro_batches=pp if pp > 1 else 1,
                )
                problems = layout_problems(base, shape, gpus)
                if problems:
                    result.rejected[family] = "; ".join(problems)
                    continue
                best_miss: tuple[float, str] | None = None
                found = False
                batches = _batches(dp // cp, pp, global_batch, per_replica_batch, micro_batch_sizes)
                for layout in _options(base, shape, batches):
                    if layout_problems(layout, shape, gpus):
                        continue
                    result.tried += 1
                    ranks = rank_memory(model, layout, shape, cache=cache)
                    worst = max(ranks, key=lambda r: r.device_total)
                    if worst.device_total > budget:
                        if best_miss is None or worst.device_total < best_miss[0]:
                            best_miss = (
                                worst.device_total,
                                f"out of memory on {worst.label}: {worst.device_total / 2**20:,.1f} MiB"
                                f" > {budget / 2**20:,.1f} MiB usable, even with {layout.short()}",
                            )
                        continue
                    found = True
                    fits.append(Candidate(layout, ranks, step_time(shape, layout, cluster)))
                if not found:
                    result.rejected[family] = (
                        best_miss[1]
                        if best_miss
                        else (
                            f"no micro-batch size of {micro_batch_sizes} divides the batch"
                            f" ({global_batch or per_replica_batch}) over {dp} replicas with a schedule that runs it"
                        )
                    )
    fits.sort(key=lambda c: -c.time.tokens_per_s)
    result.fastest = fits[:top]
    return result
