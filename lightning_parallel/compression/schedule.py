"""When to prune, and how much: gradual magnitude pruning (Zhu and Gupta, 2017).

Pruning a trained network at once to its final sparsity costs accuracy that fine-tuning must win
back; raising the sparsity in small steps while training lets the remaining weights adapt at
every step. Between two pruning events the masks stay fixed and are re-applied after every
optimizer step, so pruned weights stay exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PruningSchedule"]

RAMPS = ("cubic", "linear")


@dataclass(frozen=True)
class PruningSchedule:
    """Sparsity ``amount`` reached in events every ``every_n_steps`` optimizer steps from ``start_step``.

    Events happen after ``start_step``, ``start_step + every_n_steps``, ... optimizer steps, the last
    at ``end_step`` (``start_step`` by default: one event, one-shot pruning; with ``start_step=0``,
    before the first step, as when a pretrained model is pruned and then fine-tuned). At an event
    the sparsity is ``amount * r``, with ``r`` the ramp of the fraction ``f`` of the schedule done:
    ``1 - (1 - f)**3`` (``"cubic"``: prune fast while many weights are redundant, slowly at the end)
    or ``f`` (``"linear"``); a gradual schedule's first event (``f = 0``) prunes nothing.
    """

    amount: float
    start_step: int = 0
    every_n_steps: int = 1
    end_step: int | None = None
    ramp: str = "cubic"

    def __post_init__(self) -> None:
        if not 0.0 <= self.amount < 1.0:
            raise ValueError(
                f"Pruning `amount={self.amount!r}` must be in [0, 1): the fraction of the selected weights set to"
                " zero (0.5 prunes half of them; 1 would remove every weight)."
            )
        if self.every_n_steps < 1:
            raise ValueError(
                f"`every_n_steps={self.every_n_steps}` must be at least 1 (optimizer steps between events)."
            )
        if self.start_step < 0:
            raise ValueError(
                f"`start_step={self.start_step}` must be >= 0 (optimizer steps before the first event)."
            )
        if self.last_step < self.start_step:
            raise ValueError(
                f"`end_step={self.end_step}` must be at least `start_step={self.start_step}`: the last event's step."
            )
        if (self.last_step - self.start_step) % self.every_n_steps:
            raise ValueError(
                f"`end_step={self.end_step}` must be `start_step` plus a multiple of `every_n_steps={self.every_n_steps}`:"
                " the last event, where the sparsity reaches `amount`."
            )
        if self.ramp not in RAMPS:
            raise ValueError(f"`ramp={self.ramp!r}` is not one of {RAMPS}.")

    @property
    def last_step(self) -> int:
        return self.end_step if self.end_step is not None else self.start_step

    def sparsity_at(self, steps_done: int) -> float | None:
        """The sparsity to prune to after ``steps_done`` optimizer steps, or None if this is no event."""
        since = steps_done - self.start_step
        if since < 0 or steps_done > self.last_step or since % self.every_n_steps:
            return None
        span = self.last_step - self.start_step
        fraction = since / span if span else 1.0
        ramp = 1.0 - (1.0 - fraction) ** 3 if self.ramp == "cubic" else fraction
        return self.amount * ramp
