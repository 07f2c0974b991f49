"""One real step of the user's code at setup, run once, watched by every step of the recipe that needs it.

The pipeline discovery (which blocks are called, which weights feed the first block and the
loss) and the plan verification (what each block really receives) both learn from the user's
own step on a real batch. :class:`SampledStep` holds that batch and a call of the step (made by
the strategy, ``strategy/sampling.py``: logging silenced, metric states restored) and runs it once
with all their probes attached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class StepProbe(Protocol):
    """Watches the sampled step: hooks in ``attach``, conclusions from the output in ``finish``."""

    needs_grad: bool

    def attach(self) -> None: ...

    def finish(self, output: Any) -> None: ...

    def detach(self) -> None: ...


@dataclass
class SampledStep:
    """The first batch of the current stage's data and the user's step, called on a batch."""

    batch: Any
    step: Callable[[Any], Any]

    def call(self) -> Any:
        return self.step(self.batch)

    def on(self, batch: Any) -> SampledStep:
        """The same step on another batch (a pipeline watches one micro-batch: the memory of one)."""
        return SampledStep(batch, self.step)

    def run(self, probes: Sequence[StepProbe]) -> None:
        """Run the step once with every probe attached (autograd on if any probe needs it)."""
        for probe in probes:
            probe.attach()
        try:
            with torch.enable_grad() if any(p.needs_grad for p in probes) else torch.no_grad():
                output = self.call()
                for probe in probes:
                    probe.finish(output)
        finally:
            for probe in probes:
                probe.detach()
