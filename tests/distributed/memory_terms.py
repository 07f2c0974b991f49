"""What the memory terms of issue 34 did in a parity run, recorded on every rank, and the checks that they engaged.

:class:`MemoryTerms` is a case's callback (``Case.callbacks``): built in every worker, for the reference too
(where it records nothing: no ``HybridParallelStrategy``). Per rank it writes ``<directory>/rank<r>.json``:

- ``weight_casts`` / ``shared_casts``: 16-bit copies of weights not kept (cast again in backward) and of
  activations kept once for several projections (``memory/casts.py``), summed over the steps;
- ``sharded_losses`` / ``gathered``: ``F.cross_entropy`` calls computed on the vocabulary shards in each
  step, and the functions that received the head's logits gathered (``tensor_parallel/vocab_loss.py``);
- ``buffers``: per pipeline stage, the receive buffers made and the bytes held after the last step
  (``pipeline/receive_buffers.py``), with the planner's count for the layout.

- ``sliced_storages`` / ``sliced_tensors`` / ``regathers``: inputs gathered over tp kept as this rank's slice
  and the all-gathers backward ran to rebuild them (``memory/regather.py``), summed over the steps.

``switch_off`` (the negative controls): ``"casts"`` keeps autocast's copies, ``"buffers"`` leaves torch's
one buffer per micro-batch, ``"regather"`` keeps gathered inputs whole; the numbers of the run do not change, only what it holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

__all__ = [
    "MemoryTerms",
    "buffers_problems",
    "casts_problems",
    "read_records",
    "regather_problems",
    "sharded_loss_problems",
]


class MemoryTerms(L.Callback):
    def __init__(self, directory: str, switch_off: tuple[str, ...] = ()) -> None:
        self.directory = Path(directory)
        self.switch_off = tuple(switch_off)
        self.record: dict[str, Any] = {
            "weight_casts": 0,
            "shared_casts": 0,
            "sliced_storages": 0,
            "sliced_tensors": 0,
            "regathers": 0,
            "sharded_losses": [],
            "gathered": [],
        }

    def _hybrid(self, trainer: L.Trainer) -> bool:
        return hasattr(trainer.strategy, "casts")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._hybrid(trainer):
            return
        if "casts" in self.switch_off and trainer.strategy.casts is not None:
            trainer.strategy.casts.weights = trainer.strategy.casts.activations = False
        if "buffers" in self.switch_off:
            for stage in trainer.strategy.pipeline_stages:  # before the first schedule makes its buffers
                stage.receive_buffers.enabled = False
        if "regather" in self.switch_off and trainer.strategy.regather is not None:
            trainer.strategy.regather.enabled = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._hybrid(trainer):
            return
        casts = trainer.strategy.casts
        if casts is not None:
            self.record["weight_casts"] += casts.stats.weight_casts
            self.record["shared_casts"] += casts.stats.shared_casts
        regather = trainer.strategy.regather
        if regather is not None:  # the step's backward has run: its gathers are counted
            self.record["sliced_storages"] += regather.stats.storages
            self.record["sliced_tensors"] += regather.stats.tensors
            self.record["regathers"] += regather.stats.gathers
        mode = trainer.strategy.parallelized.loss_state.mode
        if mode is not None:
            self.record["sharded_losses"].append(mode.sharded_losses)
            self.record["gathered"] = sorted(set(self.record["gathered"]) | mode.gathered)
        self.record["buffers"] = _buffers(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._hybrid(trainer):
            return
        runner = trainer.strategy.pipeline_runner  # a head held for a tied weight runs on the last stage only
        last = runner is None or runner.holds_last_stage
        self.record["has_head"] = trainer.strategy.parallelized.loss_state.mode is not None and last
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"rank{dist.get_rank()}.json").write_text(json.dumps(self.record))


def _buffers(trainer: L.Trainer) -> list[dict[str, Any]]:
    from lightning_parallel.pipeline.receive_buffers import buffers_in_flight, receive_buffer_bytes

    config = trainer.strategy.config.pipeline
    out = []
    for stage in trainer.strategy.pipeline_stages:
        predicted = buffers_in_flight(config.spec, config.pipeline_parallel, config.virtual_stages,
                                      config.micro_batches)  # fmt: skip
        out.append({
            "stage": stage.stage_index, "made": stage.receive_buffers.peak, "predicted": predicted[stage.stage_index],
            "held_bytes": receive_buffer_bytes(stage), "enabled": stage.receive_buffers.enabled,
        })  # fmt: skip
    return out


def read_records(directory: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world_size)]


def sharded_loss_problems(records: list[dict[str, Any]], per_step: int) -> list[str]:
    """Every rank holding the head computed each loss of every step on the shards (``per_step``: one per
    micro-batch; torch's metadata inference may run one more in the first step), never gathering the logits."""
    problems = []
    for rank, record in enumerate(records):
        if not record["has_head"]:
            continue
        if not record["sharded_losses"] or min(record["sharded_losses"]) < per_step:
            problems.append(
                f"rank {rank}: {record['sharded_losses']} sharded losses per step, not {per_step}"
            )
        if record["gathered"]:
            problems.append(f"rank {rank}: logits gathered for {record['gathered']}")
    if not any(record["has_head"] for record in records):
        problems.append("no rank holds a vocabulary-sharded head")
    return problems


def casts_problems(records: list[dict[str, Any]], shared: bool) -> list[str]:
    """Every rank kept no 16-bit weight copy (and, ``shared``, shared the casts of an input read twice)."""
    problems = [
        f"rank {r}: no weight cast left out" for r, rec in enumerate(records) if not rec["weight_casts"]
    ]
    if shared:
        problems += [
            f"rank {r}: no input cast shared" for r, rec in enumerate(records) if not rec["shared_casts"]
        ]
    return problems


def buffers_problems(records: list[dict[str, Any]]) -> list[str]:
    """Every stage made exactly the receive buffers the planner counts, and holds no more."""
    problems = []
    for rank, record in enumerate(records):
        for stage in record.get("buffers") or []:
            if not stage["enabled"] or stage["made"] != stage["predicted"]:
                problems.append(f"rank {rank} stage {stage['stage']}: {stage['made']} buffers made, the planner"
                                f" counts {stage['predicted']} (reuse on: {stage['enabled']})")  # fmt: skip
    if not any(record.get("buffers") for record in records):
        problems.append("no pipeline stage")
    return problems


def regather_problems(records: list[dict[str, Any]], at_least: int) -> list[str]:
    """What is wrong with the gathered inputs a tp run kept: every rank sliced ``at_least`` storages over the
    run (e.g. two per block and step: its attention's and MLP's inputs) and rebuilt each one in backward."""
    problems = []
    for rank, record in enumerate(records):
        storages, gathers = record["sliced_storages"], record["regathers"]
        if storages < at_least:
            problems.append(f"rank {rank}: {storages} gathered inputs kept as slices, fewer than {at_least}")
        if gathers < storages:
            problems.append(f"rank {rank}: {gathers} gathers in backward for {storages} slices")
    return problems
