"""The rules by which a pipelined step's sends are let go (``pipeline/send_release.py``), on stand-in works.

Measured in a real step on two ranks in ``tests/strategy/test_memory_terms.py``; here each rule alone, with what a
CPU run cannot show: a batch reported complete (NCCL's way) goes at the next exchange without another wait; an
incomplete batch with no evidence stays (never waited on: its peer may not have posted the receive); a forward
send is waited on once its stage has run the micro-batch's backward; torch's own list is emptied in place.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_parallel.pipeline.send_release import SendRelease


class _Work:
    def __init__(self, *, completed: bool) -> None:
        self.completed, self.waits = completed, 0

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> bool:
        self.waits += 1
        return True


class _Stage:
    """A stage as torch's runtime uses it here: a forward cache by micro-batch, and its forward sends."""

    def __init__(self) -> None:
        self.fwd_cache: dict[int, Any] = {}

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return [SimpleNamespace(op=dist.isend, tensor=torch.ones(4))]  # type: ignore[list-item]


def test_sends_go_by_completion_or_by_their_stage_s_backward(monkeypatch: Any) -> None:
    made: list[list[_Work]] = []
    completed = {"grad": False, "done": True, "forward": False}

    def original(p2p_ops: list[Any], desc: str | None = None) -> list[_Work]:
        works = [_Work(completed=completed[desc]) if desc else _Work(completed=False) for _ in p2p_ops]
        made.append(list(works))  # the Work objects, apart from the list the caller may see emptied
        return works

    monkeypatch.setattr(torch_schedules, "_batch_p2p", original)
    stage, release = _Stage(), SendRelease()
    with release.during_step([stage]):
        batch = torch_schedules._batch_p2p  # what torch's runtime calls, looked up at call time
        stage.fwd_cache[0] = "output"
        forward = batch(stage.get_fwd_send_ops(0), desc="forward")
        gradient = batch([SimpleNamespace(op=dist.isend, tensor=torch.ones(4))], desc="grad")
        done = batch([SimpleNamespace(op=dist.isend, tensor=torch.ones(4))], desc="done")
        batch([], desc=None)  # the next exchange: the complete batch goes, without a wait
        assert done == [] and made[2][0].waits == 0
        assert len(forward) == 1 and len(gradient) == 1  # no evidence yet: kept, not waited on
        assert made[0][0].waits == made[1][0].waits == 0
        del stage.fwd_cache[0]  # the stage ran micro-batch 0's backward
        batch([], desc=None)
        assert forward == [] and made[0][0].waits == 1  # waited on once, then let go
        assert len(gradient) == 1 and made[1][0].waits == 0  # still no evidence for the gradient
        assert release.released == 2
    assert torch_schedules._batch_p2p is original and "get_fwd_send_ops" not in vars(stage)


def test_switched_off_it_changes_nothing(monkeypatch: Any) -> None:
    def original(p2p_ops: list[Any], desc: str | None = None) -> list[_Work]:
        return [_Work(completed=True) for _ in p2p_ops]

    monkeypatch.setattr(torch_schedules, "_batch_p2p", original)
    stage, release = _Stage(), SendRelease(enabled=False)
    with release.during_step([stage]):
        assert torch_schedules._batch_p2p is original
        sent = torch_schedules._batch_p2p(stage.get_fwd_send_ops(0))
        torch_schedules._batch_p2p([])
    assert len(sent) == 1 and release.released == 0
