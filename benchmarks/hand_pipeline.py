"""The pipeline a Lightning user writes without the strategy: the reference side of the ``pp`` pairs.

Stages cut by hand from the recipe GPT, torch's ``PipelineStage`` and schedule classes driven from a
``training_step`` with manual optimization, under Lightning's ``ModelParallelStrategy`` (which starts
the processes and calls ``configure_model``, where the stages are built). It does what such a user
must do and nothing more:

- the tied embedding (first stage) and head (last stage) become two weights; their gradients are
  summed over the two ranks after the schedule, so both stay one matrix;
- the loss exists on the last stage only; it is sent to every rank so that ``self.log`` on rank 0
  (the first stage, where Lightning's logger writes) logs it, and the optimizer and the learning-rate
  schedule are stepped by hand.

Both sides of a pair thus run Lightning's loop, logging and learning-rate schedule; what differs is
the pipeline: cut by hand here, by ``HybridParallelStrategy(pipeline_parallel=2)`` from the unchanged
module on the other side.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recipes.gpt.module import GPTLightningModule


class Stage(nn.Module):
    """A slice of the recipe GPT: the embeddings (first), blocks, the final norm and head (last)."""

    def __init__(self, gpt: Any, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        t = gpt.transformer
        if first:
            self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
        self.blocks = nn.ModuleList([t.h[i] for i in blocks])
        if last:
            self.ln_f, self.lm_head = t.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class HandPipelineGPT(GPTLightningModule):
    """The recipe's module, its step driving torch's schedule over stages cut in ``configure_model``."""

    def __init__(self, pipeline_schedule: str = "1f1b", micro_batches: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.pipeline_schedule, self.micro_batches = pipeline_schedule, micro_batches

    def configure_model(self) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        if hasattr(self, "stages"):
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        per_rank = 2 if self.pipeline_schedule == "interleaved_1f1b" else 1
        num_stages = world * per_rank
        gpt = self.model
        n = len(gpt.transformer.h)
        mine = [rank + world * v for v in range(per_rank)]  # loop placement: rank r holds r, r + P, ...
        modules = [
            Stage(copy.deepcopy(gpt), range(s * n // num_stages, (s + 1) * n // num_stages),
                  first=s == 0, last=s == num_stages - 1)
            for s in mine
        ]  # fmt: skip
        del self.model  # the optimizer sees the stages' weights only
        self.stages = nn.ModuleList(modules)
        device = self.device
        torch_stages = [PipelineStage(m, s, num_stages, device) for m, s in zip(modules, mine, strict=True)]
        self.holds_first, self.holds_last = 0 in mine, num_stages - 1 in mine
        self.last_rank = (num_stages - 1) % world
        self.tied = [m.wte.weight for m in modules if m.first] + [m.lm_head.weight for m in modules if m.last]
        if per_rank > 1:
            self.runner = ScheduleInterleaved1F1B(torch_stages, self.micro_batches, loss_fn=_loss)
        else:
            single = ScheduleGPipe if self.pipeline_schedule == "gpipe" else Schedule1F1B
            self.runner = single(torch_stages[0], self.micro_batches, loss_fn=_loss)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if self.holds_first and self.holds_last:
            self.runner.step(x, target=y, losses=losses)
        elif self.holds_first:
            self.runner.step(x)
        else:
            self.runner.step(target=y, losses=losses)
        for weight in self.tied:  # the embedding on the first stage, the head on the last: one matrix
            dist.all_reduce(weight.grad)
        optimizer.step()
        scheduler.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank)  # logged on rank 0, which holds the first stage
        self.log("train_loss", loss, prog_bar=True)


def hand_pipeline_model(schedule: str, micro_batches: int, **gpt_kwargs: Any) -> HandPipelineGPT:
    """:class:`HandPipelineGPT` with the recipe model's weights for the same seed and shape."""
    from benchmarks.common import recipe_model

    return recipe_model(
        cls=HandPipelineGPT, pipeline_schedule=schedule, micro_batches=micro_batches, **gpt_kwargs
    )
