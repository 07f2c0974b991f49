"""Schedule names as users write them, and what each one needs from the layout.

The schedules themselves are ``torch.distributed.pipelining``'s; this module only maps plain
strings to them and decides which rank holds which stage. The user's schedule arguments (name,
stages per rank, micro-batches) are checked in ``config/arguments.py``, before any process could
hang inside a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import schedules as torch_schedules


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its torch class name, stages per rank and placement of stages on ranks.

    ``placement`` is ``"single"`` (stage s on rank s), ``"loop"`` (stage s on rank s % P:
    interleaved 1F1B, looped BFS, interleaved zero bubble) or ``"v"`` (stages 0..P-1 go down
    the ranks and P..2P-1 come back up, as ZB-V and DualPipe-V need).
    """

    name: str
    torch_name: str
    placement: str
    fixed_virtual_stages: int | None = None  # V schedules always hold exactly 2 stages per rank
    bubble_free_backward: bool = False  # splits backward into input and weight gradients

    @property
    def multi_stage(self) -> bool:
        return self.placement != "single"


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", "GPipe", "single"),
        ScheduleSpec("1f1b", "1F1B", "single"),
        ScheduleSpec("interleaved_1f1b", "Interleaved1F1B", "loop"),
        ScheduleSpec("looped_bfs", "LoopedBFS", "loop"),
        ScheduleSpec("interleaved_zero_bubble", "InterleavedZeroBubble", "loop", bubble_free_backward=True),
        ScheduleSpec("zbv", "ZBVZeroBubble", "v", fixed_virtual_stages=2, bubble_free_backward=True),
        ScheduleSpec("dualpipev", "DualPipeV", "v", fixed_virtual_stages=2, bubble_free_backward=True),
    )
}
ALIASES = {
    "zero_bubble": "interleaved_zero_bubble",
    "zb_v": "zbv",
    "zbvzerobubble": "zbv",
    "dualpipe_v": "dualpipev",
    "interleaved1f1b": "interleaved_1f1b",
    "loopedbfs": "looped_bfs",
    "interleavedzerobubble": "interleaved_zero_bubble",
}
DEFAULT_SCHEDULE = "1f1b"


def available_schedules() -> list[str]:
    """Names this torch version offers (older versions lack the zero-bubble ones)."""
    return [name for name, spec in SCHEDULES.items() if hasattr(torch_schedules, _class_name(spec))]


def _class_name(spec: ScheduleSpec) -> str:
    return torch_schedules.get_schedule_class(spec.torch_name).__name__


def stage_owner(spec: ScheduleSpec, stage: int, pipeline_parallel: int) -> int:
    """The pipeline rank that holds ``stage``."""
    if spec.placement == "v":
        return stage if stage < pipeline_parallel else 2 * pipeline_parallel - 1 - stage
    return stage % pipeline_parallel


def stages_of_rank(spec: ScheduleSpec, rank: int, pipeline_parallel: int, virtual_stages: int) -> list[int]:
    total = pipeline_parallel * virtual_stages
    return [s for s in range(total) if stage_owner(spec, s, pipeline_parallel) == rank]


def ideal_efficiency(
    spec: ScheduleSpec, micro_batches: int, pipeline_parallel: int, virtual_stages: int
) -> float:
    """Fraction of time a rank computes in the ideal schedule (no communication cost).

    1F1B and GPipe: M / (M + P - 1). Interleaving with V stages per rank shrinks the bubble V
    times (Narayanan et al., 2021): M / (M + (P - 1) / V). Zero-bubble schedules fill the
    bubble with weight-gradient work: ideally 1.
    """
    m, p = micro_batches, pipeline_parallel
    if spec.bubble_free_backward:
        return 1.0
    if spec.multi_stage:
        return m / (m + (p - 1) / virtual_stages)
    return m / (m + p - 1)
