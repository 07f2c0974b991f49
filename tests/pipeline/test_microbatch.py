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
