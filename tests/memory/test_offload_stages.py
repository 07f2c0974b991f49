"""Activation offload on a rank that holds two pipeline stages (interleaved schedules), in one process.

Under pipeline stages a rank runs the model's forward once per (stage, micro-batch), passing through the
blocks of its other stage (their forward pre-hooks still fire), and the schedule interleaves the forwards of
micro-batches and stages with backwards. The saver must group what it saves by (stage, micro-batch, block):
each stage's last block stays on the device (its backward comes first) and the backward of a block prefetches
the block before it in the same stage and micro-batch, never another micro-batch's. Negative control: the
saver without the stages (one group per block entry, the keying before) sends stage 0's last block to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from lightning_parallel.memory import ActivationSaver
from lightning_parallel.memory import saved_tensors as saved_tensors_module

WIDTH, STAGE_OF_BLOCK = 8, (0, 0, 1, 1)


@dataclass
class Running:
    stage: int | None = None
    micro_batch: int | None = None

    def __call__(self) -> tuple[int, int] | None:
        return None if self.stage is None or self.micro_batch is None else (self.stage, self.micro_batch)


class GatedBlock(nn.Module):
    """A block of one stage: passes its input through while another stage of the rank runs (as the runtime's gate)."""

    def __init__(self, stage: int, running: Running) -> None:
        super().__init__()
        self.stage, self.running, self.linear = stage, running, nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.running.stage != self.stage:
            return x
        return torch.tanh(self.linear(x))


def _run(saver_of: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list]:
    """Interleaved order on one rank: stage 0 of micro-batches 0 and 1, stage 1 of both, then backwards of
    stage 1 and stage 0, micro-batch by micro-batch. Returns the stored groups (group -> offloaded) and the
    prefetches made during each backward, with the (stage, micro-batch) whose backward ran."""
    torch.manual_seed(0)
    running = Running()
    blocks = nn.ModuleList(GatedBlock(s, running) for s in STAGE_OF_BLOCK)
    staged = {"block_stages": list(STAGE_OF_BLOCK), "running": running} if saver_of == "stages" else {}
    saver = ActivationSaver(offload=True, parameters=list(blocks.parameters()), blocks=list(blocks), **staged)
    stored: dict[tuple[int, int, int], bool] = {}
    prefetches: list[tuple[tuple[int, int], tuple[int, int, int]]] = []
    backward_of: list[tuple[int, int]] = []
    original_init = saved_tensors_module._StoredStorage.__init__
    original_prefetch = ActivationSaver._prefetch

    def record_init(self, flat, compression, *, offload, group, buffers, stream=None):  # type: ignore[no-untyped-def]
        original_init(self, flat, compression, offload=offload, group=group, buffers=buffers, stream=stream)
        stored[group] = stored.get(group, False) or offload

    def record_prefetch(self, group, device):  # type: ignore[no-untyped-def]
        if group is not None and group not in self._prefetched and self._groups.get(group):
            prefetches.append((backward_of[-1], group))
        original_prefetch(self, group, device)

    monkeypatch.setattr(saved_tensors_module._StoredStorage, "__init__", record_init)
    monkeypatch.setattr(ActivationSaver, "_prefetch", record_prefetch)
    inputs = [torch.randn(2, WIDTH, requires_grad=True) for _ in range(2)]
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    received: dict[int, torch.Tensor] = {}
    with saver.context():
        for stage, micro_batch in ((0, 0), (0, 1), (1, 0), (1, 1)):
            running.stage, running.micro_batch = stage, micro_batch
            x = inputs[micro_batch] if stage == 0 else received[micro_batch]
            for block in blocks:
                x = block(x)
            if stage == 0:
                received[micro_batch] = x.detach().requires_grad_()
            outputs[(stage, micro_batch)] = x
        running.stage = running.micro_batch = None
    for micro_batch in (0, 1):
        backward_of.append((1, micro_batch))
        outputs[(1, micro_batch)].pow(2).sum().backward()
        backward_of.append((0, micro_batch))
        outputs[(0, micro_batch)].backward(received[micro_batch].grad)
    saver.remove()
    return stored, prefetches


def test_each_stage_keeps_its_last_block_and_prefetches_only_its_own_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stored, prefetches = _run("stages", monkeypatch)
    # every (stage, micro-batch) stored its two blocks; the first block went to the host, the last stayed
    for stage in (0, 1):
        for micro_batch in (0, 1):
            assert stored[(stage, micro_batch, 0)] is True, (stage, micro_batch, stored)
            assert stored[(stage, micro_batch, 1)] is False, (stage, micro_batch, stored)
    # the blocks of other stages, passed through, stored nothing
    assert {group[2] for group in stored} <= {-1, 0, 1}
    # each backward brought back its own stage's and micro-batch's first block, one ahead
    assert prefetches == [((s, m), (s, m, 0)) for m in (0, 1) for s in (1, 0)], prefetches


def test_without_the_stages_stage_zero_last_block_goes_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    stored, _ = _run("flat", monkeypatch)
    # keyed by block entry alone, the four blocks are one stage: stage 0's last block (position 1) is offloaded
    assert any(offloaded for (_, _, position), offloaded in stored.items() if position == 1), stored
