"""What ``setup`` made of the strategy's arguments, read back by name (the arguments themselves: ``strategy/asked.py``).

After ``setup`` the strategy holds a :class:`~lightning_parallel.parallelize.Parallelized` (the plan, the pipeline
runner and its stages, the loss it chose); these read-only properties give its parts under the names users and
callbacks read (``print(trainer.strategy.plan)``, ``trainer.strategy.pipeline_stages``), and None or empty before.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.config.parallel_config import ParallelConfig
from lightning_parallel.memory.counting import ActivationBytes, SavedTensorCounter
from lightning_parallel.parallelize import Parallelized
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.tensor_parallel import ParallelPlan

__all__ = ["SetupResults"]


class SetupResults:
    """Read-only views of ``self.parallelized`` (a mixin of the strategy)."""

    config: ParallelConfig
    parallelized: Parallelized | None
    activation_counter: SavedTensorCounter | None

    @property
    def loss_parallel(self) -> bool | None:
        """Whether the loss is vocabulary-parallel: as asked (None: where a head is sharded) until setup
        decides, by the sharded head it found (or not)."""
        p = self.parallelized
        return (p.loss_parallel or p.loss_state.mode is not None) if p else self.config.tensor.loss_parallel

    @property
    def plan(self) -> ParallelPlan | None:
        """The tensor-parallel plan applied at setup (``print(trainer.strategy.plan)``)."""
        return self.parallelized.plan if self.parallelized else None

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        return self.parallelized.pipeline if self.parallelized else None

    @property
    def pipeline_stages(self) -> list[Any]:
        """This rank's ``torch.distributed.pipelining.PipelineStage`` objects (empty without pipelining)."""
        runner = self.pipeline_runner
        return list(runner.stages) if runner is not None else []

    @property
    def pipeline_group(self) -> torch.distributed.ProcessGroup | None:
        runner = self.pipeline_runner
        return runner.pp_group if runner is not None else None

    @property
    def activation_bytes(self) -> ActivationBytes | None:
        """The last counted step's :class:`~lightning_parallel.memory.counting.ActivationBytes` (or None)."""
        return self.activation_counter.bytes if self.activation_counter is not None else None
