"""Pipeline timeline: what each pipeline rank computed, and when, during one training step.

A pipeline schedule is judged by its bubble: the share of the step in which ranks sit idle,
waiting for activations or gradients. Schedules differ exactly there (GPipe, 1F1B, interleaved,
zero-bubble), and the differences are easiest to see drawn. :class:`PipelineTimeline` records,
for one training step, every compute call the schedule makes on this rank's
``torch.distributed.pipelining`` stages, gathers the spans over the pipeline group, measures the
bubble fraction and draws a Gantt chart (one lane per pipeline rank)::

    trainer = Trainer(strategy=..., callbacks=[PipelineTimeline(step=3, path="timeline.png")])

The pure functions :func:`bubble_fraction` and :func:`render_timeline` work on any list of
:class:`Span`, so a benchmark can use them without a Trainer.

How spans are taken: the callback replaces the stages' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` by instance attributes that time the
original bound methods, and removes them after the step (torch itself is untouched). Those three
methods are pure compute: the schedule waits for received activations and gradients before
calling them, so waiting shows as gaps between spans, which is what the bubble fraction counts.
The loss computed on the last stage is done by the schedule outside these calls, so it falls in
no span.

Clocks: each rank takes its time origin right after a barrier on the pipeline group, so origins
agree to within the barrier's release skew (microseconds to a fraction of a millisecond), on one
machine or several. On CPU the spans are ``time.perf_counter`` offsets. On CUDA, host time would
measure kernel launches, not kernels, so spans are CUDA events on the current stream, read after
the step; synchronizing the host around each call instead could stall the schedule's pending
point-to-point transfers.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["KINDS", "PipelineTimeline", "Span", "bubble_fraction", "render_timeline"]

#: Kinds of span, in drawing (and legend) order.
KINDS: tuple[str, ...] = ("forward", "backward", "backward_input", "weight")

_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "backward_input": "#C44E52",
    "weight": "#55A868",
}

_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


@dataclass(frozen=True)
class Span:
    """One compute call of a pipeline stage.

    ``rank`` is the rank in the pipeline group (the lane), ``stage`` the stage index (a rank of an
    interleaved or V schedule holds several), ``microbatch`` the schedule's microbatch id,
    ``kind`` one of :data:`KINDS`, ``start`` and ``end`` seconds from the common origin.
    """

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def _busy_time(spans: Sequence[Span]) -> float:
    """Length of the union of the spans' intervals: overlapping spans must not count twice."""
    busy = 0.0
    cursor = -math.inf
    for span in sorted(spans, key=lambda s: s.start):
        start = max(span.start, cursor)
        if span.end > start:
            busy += span.end - start
        cursor = max(cursor, span.end)
    return busy


def bubble_fraction(spans: Sequence[Span], num_ranks: int | None = None) -> float:
    """Share of the step's rank-time spent idle: ``1 - busy / (num_ranks * makespan)``.

    ``makespan`` is from the first span's start to the last span's end over all ranks (so time
    before the first forward and after the last backward, such as the optimizer step, is not in
    it). ``num_ranks`` defaults to the number of distinct ranks in ``spans``; pass it when a rank
    may have recorded nothing. Per rank, busy time is the union of its spans.
    """
    if not spans:
        raise ValueError("bubble_fraction needs at least one span")
    ranks = {s.rank for s in spans}
    if num_ranks is None:
        num_ranks = len(ranks)
    elif num_ranks < len(ranks):
        raise ValueError(f"num_ranks={num_ranks} but the spans hold {len(ranks)} ranks")
    makespan = max(s.end for s in spans) - min(s.start for s in spans)
    if makespan <= 0:
        raise ValueError("The spans have no extent in time (makespan <= 0)")
    busy = sum(_busy_time([s for s in spans if s.rank == r]) for r in ranks)
    return 1.0 - busy / (num_ranks * makespan)


def render_timeline(
    spans: Sequence[Span],
    path: str | Path,
    title: str | None = None,
    num_ranks: int | None = None,
) -> Path:
    """Draw ``spans`` as a Gantt chart (one lane per rank, rank 0 on top) into a PNG at ``path``.

    Boxes are coloured by kind and labelled with the microbatch id, prefixed by the stage index
    (``s2:5``) when some rank holds several stages. The bubble fraction is appended to ``title``.
    Uses matplotlib's Agg canvas directly, so it neither needs a display nor changes pyplot's
    global backend. Returns the path written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:  # matplotlib is an optional dependency of this project
        raise ImportError("render_timeline needs matplotlib: pip install matplotlib") from err
    if not spans:
        raise ValueError("render_timeline needs at least one span")

    ranks = sorted({s.rank for s in spans})
    lanes = max(num_ranks or 0, ranks[-1] + 1)
    origin = min(s.start for s in spans)
    makespan_ms = (max(s.end for s in spans) - origin) * 1e3
    stages_per_rank = {r: {s.stage for s in spans if s.rank == r} for r in ranks}
    show_stage = any(len(stages) > 1 for stages in stages_per_rank.values())

    # Wider for long schedules (~0.12 inch per span of the busiest lane, up to 48 inches), so that
    # boxes stay wide enough to carry their labels.
    busiest = max(sum(1 for s in spans if s.rank == r) for r in ranks)
    width_in = min(48.0, max(12.0, 0.12 * busiest))
    fig = Figure(figsize=(width_in, 1.2 + 0.6 * lanes), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # A label is drawn only in a box wide enough for it: a 7-point character is ~0.06 inch, and
    # the axis is the figure less ~1.8 inches of tick labels and legend.
    min_width_per_char = makespan_ms * 0.06 / (width_in - 1.8) if makespan_ms > 0 else math.inf
    for span in spans:
        left = (span.start - origin) * 1e3
        width = span.duration * 1e3
        ax.broken_barh(
            [(left, width)],
            (span.rank - 0.4, 0.8),
            facecolors=_COLORS.get(span.kind, "#8C8C8C"),
            edgecolors="black",
            linewidth=0.3,
        )
        label = f"s{span.stage}:{span.microbatch}" if show_stage else str(span.microbatch)
        if width >= min_width_per_char * (len(label) + 1):
            ax.text(left + width / 2, span.rank, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_ylim(lanes - 0.5, -0.5)
    ax.set_yticks(range(lanes), [f"rank {r}" for r in range(lanes)])
    ax.set_xlim(0, makespan_ms if makespan_ms > 0 else 1.0)
    ax.set_xlabel("time (ms)")
    kinds = [k for k in KINDS if any(s.kind == k for s in spans)]
    kinds += sorted({s.kind for s in spans} - set(KINDS))
    ax.legend(
        handles=[Patch(color=_COLORS.get(k, "#8C8C8C"), label=k) for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    try:
        bubble = f"bubble fraction {bubble_fraction(spans, lanes):.1%}"
    except ValueError:  # only zero-length spans: nothing to measure
        bubble = "bubble fraction n/a"
    ax.set_title(f"{title}\n{bubble}" if title else bubble, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


class _Clock:
    """Time stamps on one rank, relative to an origin taken right after a pipeline barrier.

    Stamps are opaque (a float, or a CUDA event) until :meth:`seconds`, which may synchronize,
    so reading them is deferred to the end of the step.
    """

    def __init__(self, device: torch.device | None) -> None:
        self.cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self._origin: Any = None

    def start(self) -> None:
        self._origin = self.stamp()

    def stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def seconds(self, stamp: Any) -> float:
        if self.cuda:
            stamp.synchronize()
            return self._origin.elapsed_time(stamp) / 1e3
        return stamp - self._origin


class _Recorder:
    """Times the compute methods of one rank's stages by shadowing them with instance attributes."""

    def __init__(self, stages: Sequence[Any], rank: int) -> None:
        self.stages = list(stages)
        self.rank = rank
        self.clock = _Clock(getattr(self.stages[0], "device", None))
        self._raw: list[tuple[int, int, str, Any, Any]] = []  # stage, microbatch, kind, start, end stamps
        self._saved: list[tuple[Any, str, bool, Any]] = []  # stage, name, had instance attribute, its value

    def install(self) -> None:
        for stage in self.stages:
            for name in _METHODS:
                had = name in vars(stage)
                self._saved.append((stage, name, had, vars(stage).get(name)))
                setattr(stage, name, self._wrap(stage, name, getattr(stage, name)))

    def remove(self) -> None:
        """Restore what the stages had before :meth:`install`; safe to call twice."""
        for stage, name, had, value in reversed(self._saved):
            if had:
                setattr(stage, name, value)
            else:
                vars(stage).pop(name, None)
        self._saved.clear()

    def _wrap(self, stage: Any, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)
        stage_index = int(stage.stage_index)
        raw = self._raw
        clock = self.clock

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # Bind to the real signature: schedules pass the chunk id and ``full_backward``
            # positionally or by keyword, and differ between schedule families.
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            microbatch = int(next(iter(bound.arguments.values())))  # the chunk id comes first
            if name == "forward_one_chunk":
                kind = "forward"
            elif name == "backward_weight_one_chunk":
                kind = "weight"
            else:
                kind = "backward" if bound.arguments.get("full_backward", True) else "backward_input"
            start = clock.stamp()
            try:
                return method(*args, **kwargs)
            finally:
                raw.append((stage_index, microbatch, kind, start, clock.stamp()))

        return timed

    def spans(self) -> list[Span]:
        return [
            Span(self.rank, stage, mb, kind, self.clock.seconds(start), self.clock.seconds(end))
            for stage, mb, kind, start, end in self._raw
        ]


class PipelineTimeline(Callback):
    """Record one training step of a pipeline schedule; draw it and measure its bubble fraction.

    At the start of the training batch whose ``trainer.global_step == step`` (the first one, under
    gradient accumulation), every rank wraps the compute methods of its
    ``trainer.strategy.pipeline_stages`` and aligns its clock with a barrier on
    ``trainer.strategy.pipeline_group``. At the end of that batch the wrappers are removed, the
    spans are gathered over the pipeline group, and on every rank :attr:`spans` and
    :attr:`bubble_fraction` are set and ``pipeline_bubble_fraction`` is logged (the same value on
    all ranks of a pipeline, so no reduction). Global rank 0 writes the PNG at ``path`` and, if
    given, the spans as JSON at ``json_path``; with several pipelines (data parallelism) it draws
    its own, as all replicas run the same schedule.

    ``step`` defaults to 3 so that one-off work of the first steps (shape inference, allocator
    warm-up, lazy initialization) is not in the picture.
    """

    def __init__(
        self, step: int = 3, path: str | Path = "pipeline_timeline.png", json_path: str | Path | None = None
    ) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.step = step
        self.path = Path(path)
        self.json_path = Path(json_path) if json_path is not None else None
        self.spans: list[Span] | None = None
        self.bubble_fraction: float | None = None
        self._recorder: _Recorder | None = None
        self._done = False
        self._warned = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._done or self._recorder is not None or trainer.global_step != self.step:
            return
        stages = list(getattr(trainer.strategy, "pipeline_stages", None) or [])
        if not stages:
            if not self._warned:
                rank_zero_warn(
                    f"PipelineTimeline: {type(trainer.strategy).__name__} exposes no `pipeline_stages`;"
                    " nothing is recorded."
                )
                self._warned = True
            self._done = True
            return
        group = getattr(trainer.strategy, "pipeline_group", None)
        rank = dist.get_rank(group) if group is not None else 0
        self._recorder = _Recorder(stages, rank)
        self._recorder.install()
        if group is not None:
            dist.barrier(group=group)
        self._recorder.clock.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None:
            return
        recorder.remove()
        self._recorder = None
        self._done = True
        local = recorder.spans()
        group = getattr(trainer.strategy, "pipeline_group", None)
        if group is not None:
            gathered: list[list[Span] | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, local, group=group)
            num_ranks = len(gathered)
            spans = [span for rank_spans in gathered for span in rank_spans or []]
        else:
            num_ranks, spans = 1, local
        spans.sort(key=lambda s: (s.rank, s.start))
        self.spans = spans
        try:
            self.bubble_fraction = bubble_fraction(spans, num_ranks)
        except ValueError:  # no spans: the strategy did not run its stages in this batch
            rank_zero_warn("PipelineTimeline: no stage compute was recorded in the step; nothing written.")
            return
        pl_module.log(
            "pipeline_bubble_fraction", self.bubble_fraction, on_step=True, on_epoch=False, sync_dist=False
        )
        if trainer.global_rank == 0:
            self._write(spans, num_ranks)

    def _write(self, spans: list[Span], num_ranks: int) -> None:
        stages = sorted({s.stage for s in spans})
        microbatches = len({s.microbatch for s in spans})
        title = (
            f"Pipeline timeline, step {self.step}: {num_ranks} rank{'s' * (num_ranks != 1)}, "
            f"{len(stages)} stage{'s' * (len(stages) != 1)}, {microbatches} microbatches"
        )
        render_timeline(spans, self.path, title, num_ranks)
        if self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "step": self.step,
                "num_ranks": num_ranks,
                "bubble_fraction": self.bubble_fraction,
                "spans": [asdict(s) for s in spans],
            }
            self.json_path.write_text(json.dumps(payload, indent=1))

    def _abort(self) -> None:
        """Put the stages' own methods back if the recorded step never reached its end."""
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._abort()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._abort()
