"""State one block hands a later one besides the hidden state: found, kept within one stage, or refused, named.

Two ways a model does it that the hidden state's autograd cannot show: a block writes into a container every
block receives (``gemma3n``'s and ``kolibri``'s ``shared_kv_states``, a ``UserDict``) and a later block reads it;
a block returns a second tensor, integers, that the model's loop hands to the next (``hy_v4``'s
``prev_topk_indices``). Each makes a pair of blocks the stage split keeps together (``pipeline/setup.py``),
refusing where no split can (or the user's boundaries cut it). Negative controls: a container the blocks only read (tables made at model level), a
second output the loop collects without handing it on, and one handed on that the next block never computes
with (GLM-DSA's top-k indices reaching a layer that selects its own) are accepted.
"""

from __future__ import annotations

from collections import UserDict
from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.discover import Discovery, PipelineSetupError, discover
from lightning_parallel.pipeline.setup import StageSplit, keep_handed_state_within_stages

WIDTH = 8


class _Block(nn.Module):
    def __init__(self, index: int, mode: str) -> None:
        super().__init__()
        self.index, self.mode = index, mode
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor, shared: UserDict, previous: torch.Tensor | None = None) -> object:
        out = hidden + self.proj(hidden)
        if self.mode == "shared_kv":
            if self.index == 0:
                shared["kv"] = self.proj(hidden)  # stored by the first block ...
            else:
                out = out + shared["kv"]  # ... read by the next
        elif self.mode == "read_only":
            out = out * shared["scale"]
        elif self.mode == "indices" and previous is not None:
            out = out + previous.unsqueeze(-1).to(out.dtype)  # a shared sparse-attention layer's selection
        if self.mode in ("indices", "unused_indices", "collected"):
            return out, out.argmax(dim=-1)
        return out


class _Model(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList(_Block(i, mode) for i in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = UserDict(scale=torch.ones(WIDTH))
        previous, collected = None, []
        for block in self.blocks:
            if self.mode in ("indices", "unused_indices"):
                x, previous = block(x, shared, previous=previous)
            elif self.mode == "collected":
                x, indices = block(x, shared)
                collected.append(indices)
            else:
                x = block(x, shared)
        return self.head(x).mean()


def _discover(mode: str) -> Discovery:
    model = _Model(mode)
    return discover(model, ["blocks.0", "blocks.1"], lambda: model(torch.randn(2, 4, WIDTH)))


@pytest.mark.parametrize(
    ("mode", "argument"), [("shared_kv", "positional argument 1"), ("indices", "previous")]
)
def test_state_a_block_hands_a_later_one_makes_a_pair_naming_the_argument(mode: str, argument: str) -> None:
    assert _discover(mode).handed == {(0, 1): argument}


@pytest.mark.parametrize("mode", ["read_only", "collected", "unused_indices"])
def test_containers_only_read_and_outputs_not_computed_with_make_no_pair(mode: str) -> None:
    assert _discover(mode).handed == {}


def test_a_split_between_the_pair_is_refused_naming_both_blocks() -> None:
    split = StageSplit(["blocks.0", "blocks.1"], [1, 1], [range(0, 1), range(1, 2)], [0, 1])
    with pytest.raises(PipelineSetupError, match=r"Block blocks\.1 receives, besides the hidden state, `previous`,"
                                                 r" written or returned by block blocks\.0 .* No split into 2"):  # fmt: skip
        keep_handed_state_within_stages(split, {(0, 1): "previous"})
    given = StageSplit(["a", "b", "c"], [1, 1, 1], [range(0, 2), range(2, 3)], [0, 1], user_boundaries=True)
    with pytest.raises(
        PipelineSetupError,
        match="Or move the boundary: `pipeline_boundaries` puts one between blocks 1 and 2",
    ):
        keep_handed_state_within_stages(given, {(1, 2): "shared"})
    moved = keep_handed_state_within_stages(replace(given, user_boundaries=False), {(1, 2): "shared"})
    assert moved.ranges == [range(0, 1), range(1, 3)]
