"""Micro-batch splitting and the replay of per-micro-batch ``self.log`` calls: pure functions."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.microbatch import LogRecorder, check_divisible, replay_logs, split_batch

Pair = namedtuple("Pair", ["x", "y"])


def test_split_keeps_the_structure_and_cuts_every_tensor() -> None:
    batch = {
        "ids": torch.arange(8).view(4, 2),
        "pair": Pair(torch.arange(4), [torch.ones(4, 1), "tag"]),
        "n": 3,
    }
    parts = split_batch(batch, 2)
    assert len(parts) == 2
    assert torch.equal(parts[1]["ids"], torch.tensor([[4, 5], [6, 7]]))
    assert isinstance(parts[0]["pair"], Pair) and torch.equal(parts[0]["pair"].x, torch.tensor([0, 1]))
    assert parts[0]["pair"].y[1] == "tag" and parts[0]["pair"].y[0].shape == (2, 1)
    assert parts[1]["n"] == 3
    assert split_batch(batch, 1) == [batch]


def test_a_batch_the_micro_batches_do_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`micro_batches=3` does not divide the batch size 4"):
        check_divisible((torch.zeros(4, 2), torch.zeros(4)), 3)
    check_divisible((torch.zeros(6, 2), torch.tensor(1.0)), 3)  # 0-d tensors are shared, not cut


class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.metric = nn.Identity()  # stands in for a torchmetrics Metric (an nn.Module)
        self.logged: list[tuple[str, Any, dict]] = []

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.logged.append((name, value, kwargs))


def test_logs_are_averaged_over_micro_batches_and_replayed_once() -> None:
    module, recorder, current = _Module(), LogRecorder(), [0]
    with recorder.recording(module, lambda: current[0]):
        for mb, loss in enumerate([1.0, 2.0, 4.0]):
            current[0] = mb
            module.log("loss", torch.tensor(loss), prog_bar=True)
            module.log("metric", module.metric)
        current[0] = 0
        module.log("loss", torch.tensor(1.0), prog_bar=True)  # a repeat of micro-batch 0 replaces it
    assert module.logged == []  # nothing reached the real log while recording
    records = recorder.averaged(module)
    replay_logs(module, records, torch.device("cpu"))
    (name, value, kwargs), (metric_name, metric, _) = module.logged
    assert name == "loss" and float(value) == pytest.approx(7 / 3) and kwargs == {"prog_bar": True}
    assert metric_name == "metric" and metric is module.metric


def _share_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from lightning_parallel.pipeline.microbatch import StepLogs

    logs, group, device = StepLogs(), dist.group.WORLD, torch.device("cpu")
    last = world_size - 1
    # the same structure twice, then many values with an extra object, then fewer values
    for count, extra in ((2, None), (2, None), (40, {"out": 7}), (3, None)):
        values = [torch.tensor(float(i) + 0.25, dtype=torch.float32) for i in range(count)]
        records = [(f"v{i}", ("value", v), {"prog_bar": i == 0}) for i, v in enumerate(values)]
        payload = (torch.tensor(1.5), records) if rank == last else None
        mean, got, got_extra = logs.share(payload, last, group, device, extra if rank == last else None)
        assert float(mean) == 1.5 and got_extra == extra
        assert [name for name, _, _ in got] == [f"v{i}" for i in range(count)]
        assert [float(v) for _, (_, v), _ in got] == [float(i) + 0.25 for i in range(count)]
        assert got[0][2] == {"prog_bar": True} and got[-1][2] == {"prog_bar": count == 1}
    # the structure went as an object only when it changed: versions 1 (2 values), 2 (40), 3 (3)
    assert logs.version == 3


def test_step_logs_reach_every_stage_in_one_message_and_more_values_in_a_second() -> None:
    """40 values exceed the 32 that travel with the header (the overflow path); repeated structures are not
    resent (the version counts the changes). Negative control: a wrong value or name fails an assertion."""
    from tests.precision import spawn_gloo

    spawn_gloo(_share_worker, 2)
