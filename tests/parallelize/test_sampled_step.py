"""The user's step runs once at setup, for the pipeline discovery and the plan verification together.

``observe_one_step`` (``parallelize/recipe.py``) hands the one sampled step to both probes; no
process group is needed (both learn from the unsharded model). The negative control is the one
case that must run the step a second time: a block argument that cannot be copied off the
autograd graph, captured again alone, without autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.parallelize import SampledStep
from lightning_parallel.parallelize.recipe import observe_one_step
from lightning_parallel.tensor_parallel import ParallelPlan
from lightning_parallel.tensor_parallel.regions import find_hidden


class Holder:
    """An argument object holding a tensor of the graph (as a cache object would)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, extra: Any = None) -> torch.Tensor:
        bias = extra.tensor if isinstance(extra, Holder) else 0.0
        return x + self.proj(torch.relu(self.fc(x))) + bias


class Model(nn.Module):
    def __init__(self, holder: bool) -> None:
        super().__init__()
        self.holder = holder
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 16)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        extra = Holder(h.mean() * 0.0) if self.holder else None  # a non-leaf tensor under autograd
        for block in self.blocks:
            h = block(h, extra)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def _observe(holder: bool, pipelined: bool = True) -> tuple[Any, Any, dict[str, int]]:
    torch.manual_seed(0)
    model = Model(holder)
    tokens = torch.randint(0, 16, (4, 6))
    counts = {"samples": 0, "steps": 0}

    def step(batch: torch.Tensor) -> torch.Tensor:
        counts["steps"] += 1
        return model.step(batch)

    def make() -> SampledStep:
        counts["samples"] += 1
        return SampledStep(tokens, step)

    strategy = HybridParallelStrategy(tensor_parallel=2, pipeline_parallel=2 if pipelined else 1)
    plan = ParallelPlan(
        tensor_parallel=2, sequence_parallel=False, block_names=[f"blocks.{i}" for i in range(4)]
    )
    pipeline = strategy.config.pipeline if pipelined else None
    layout, captured = observe_one_step(
        model, plan, plan.block_names, make, pipeline=pipeline, verifies=True, training=True
    )
    return layout, captured, counts


def test_discovery_and_verification_share_one_run_of_the_step() -> None:
    layout, captured, counts = _observe(holder=False)
    assert counts == {"samples": 1, "steps": 1}
    assert layout is not None and layout.num_stages == 2  # the discovery engaged
    assert layout.discovery.pre_parameters == {"embed.weight"} and layout.discovery.post_parameters == {
        "head.weight",
        "head.bias",
    }
    assert list(captured) == ["blocks.0"]  # the first block of the one block class
    args, kwargs = captured["blocks.0"]
    hidden = find_hidden(args, kwargs)[1]
    assert not hidden.requires_grad  # as a no-grad capture would hold it
    # the pipelined step watches one micro-batch of the 4 rows (micro_batches=2): setup never holds the
    # activations of the whole batch, which a pipeline exists to avoid
    assert hidden.shape == (2, 6, 8)


def test_tensor_parallel_alone_samples_once_without_autograd() -> None:
    layout, captured, counts = _observe(holder=False, pipelined=False)
    assert counts == {"samples": 1, "steps": 1} and layout is None and list(captured) == ["blocks.0"]
    assert find_hidden(*captured["blocks.0"])[1].shape == (4, 6, 8)  # no pipeline: the whole batch


def test_an_argument_that_cannot_leave_the_graph_is_captured_by_a_second_run() -> None:
    layout, captured, counts = _observe(holder=True)
    assert counts == {"samples": 1, "steps": 2}  # negative control: the counter sees a second run
    assert layout is not None and list(captured) == ["blocks.0"]
    assert isinstance(captured["blocks.0"][0][1], Holder)
