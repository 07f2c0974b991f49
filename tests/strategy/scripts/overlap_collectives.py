"""When each layout's data-parallel reduction runs, recorded: during the last backward, not after it.

    python tests/strategy/scripts/overlap_collectives.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Four ranks, one short fit per layout (``LAYOUTS``); the explicit reductions' buckets are made small
(``BUCKET_BYTES``) so that every rank holds several. Recorded on every rank, per layout:

- each bucket launch (``BucketedReduction.final`` or ``finish``): its bytes, the batch, whether autograd's
  engine was running a backward (``torch._C._current_graph_task_id() != -1``), whether the pipeline
  schedule was still running, and how many buckets of the same reduction still waited for
  gradients (more than zero: the launch overlapped backward work still to come);
- each FSDP2 reduce-scatter (``torch.distributed.reduce_scatter_single``; 2.11: ``reduce_scatter_tensor``), the same way;
- the buckets each reduction holds, and the FSDP2 units that manage parameters; the theoretical bytes
  of one reduction (every gradient once).

The last two layouts run with the overlap switched off (``GradientSync.begin_final`` and
``zero.fsdp_schedule.reduce_in_backward`` made no-ops, the reductions running after the schedule as before):
the negative control, which the test's checks must refuse.

Writes ``OUT_DIR/overlap_collectives.rank{r}.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.data_parallel import buckets, gradient_sync
from lightning_parallel.zero import fsdp, fsdp_schedule
from tests.models.families import build, make_dataloader

BUCKET_BYTES = 4096
STEPS = 3
# name: (family, strategy arguments, Trainer arguments, batch size per rank)
LAYOUTS: dict[str, tuple[str, dict[str, Any], dict[str, Any], int]] = {
    "pp2_dp2_1f1b": (
        "nanogpt",
        {"pipeline_parallel": 2, "micro_batches": 4, "pipeline_schedule": "1f1b"},
        {},
        4,
    ),
    "pp2_dp2_interleaved": (
        "nanogpt",
        {"pipeline_parallel": 2, "micro_batches": 2, "pipeline_schedule": "interleaved_1f1b"},
        {},
        4,
    ),
    "pp2_dp2_zbv": (
        "nanogpt",
        {"pipeline_parallel": 2, "micro_batches": 4, "pipeline_schedule": "zbv"},
        {},
        4,
    ),
    "pp2_dp2_accum": (
        "recipe_gpt",
        {"pipeline_parallel": 2, "micro_batches": 2},
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
        4,
    ),
    "ep2_dp2": ("hf_mixtral", {"expert_parallel": 2}, {}, 2),
    "zero3_pp2_1f1b": ("nanogpt", {"zero_stage": 3, "pipeline_parallel": 2, "micro_batches": 4}, {}, 4),
    "zero2_pp2_zbv": (
        "nanogpt",
        {"zero_stage": 2, "pipeline_parallel": 2, "micro_batches": 4, "pipeline_schedule": "zbv"},
        {},
        4,
    ),
}
SWITCHED_OFF = {"off_pp2_dp2_1f1b": "pp2_dp2_1f1b", "off_zero3_pp2_1f1b": "zero3_pp2_1f1b"}
DEEP = {"nanogpt": {"n_layer": 4}, "recipe_gpt": {}, "hf_mixtral": {}}

EVENTS: list[dict[str, Any]] = []
STATE = {"batch": -1, "in_schedule": False}


def _event(kind: str, nbytes: int, waiting: int = 0) -> None:
    EVENTS.append(
        {
            "kind": kind,
            "batch": STATE["batch"],
            "in_backward": torch._C._current_graph_task_id() != -1,
            "in_schedule": STATE["in_schedule"],
            "waiting": waiting,
            "bytes": nbytes,
        }
    )


def _bucket_bytes(bucket: Any) -> int:
    return bucket.numel * bucket.dtype.itemsize


def _record_bucket_launches() -> None:
    final, finish = buckets.BucketedReduction.final, buckets.BucketedReduction.finish

    def recorded_final(self: buckets.BucketedReduction, param: torch.nn.Parameter) -> None:
        before = self.launched
        final(self, param)
        for bucket in self.buckets[before : self.launched]:
            _event("bucket", _bucket_bytes(bucket), sum(1 for b in self.buckets if b.waiting > 0))

    def recorded_finish(self: buckets.BucketedReduction) -> None:
        for bucket in self.buckets[self.launched :]:
            _event("bucket", _bucket_bytes(bucket))
        finish(self)

    buckets.BucketedReduction.final = recorded_final
    buckets.BucketedReduction.finish = recorded_finish
    # FSDP2's reduce-scatter: torch 2.13 calls ``reduce_scatter_single``, 2.11 ``reduce_scatter_tensor``.
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    reduce_scatter = getattr(dist, name)

    def recorded_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _event("reduce_scatter", input.numel() * input.element_size())
        return reduce_scatter(output, input, *args, **kwargs)

    setattr(dist, name, recorded_reduce_scatter)


def _local_bytes(param: torch.nn.Parameter) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


class Probe(L.Callback):
    """Wraps the schedule's ``step`` (in the schedule or not); counts the units and their theoretical bytes."""

    units = 0
    unit_bytes = 0  # each unit's gradients once, whole (FSDP2's padded size: local shard x its mesh)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runner = trainer.strategy.pipeline_runner
        units = (
            runner.fsdp_units if runner is not None else trainer.strategy.parallelized.gradients.in_backward
        )
        managing = [fsdp.unit_parameters(unit) for unit in units]
        self.units = sum(1 for params in managing if params)  # a unit managing nothing reduces nothing
        self.unit_bytes = sum(_local_bytes(p) * p.device_mesh.size() for params in managing for p in params)
        if runner is not None:
            step = runner.schedule.step

            def timed_step(*args: Any, **kwargs: Any) -> Any:
                STATE["in_schedule"] = True
                try:
                    return step(*args, **kwargs)
                finally:
                    STATE["in_schedule"] = False

            runner.schedule.step = timed_step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        STATE["batch"] = i


def _switch_overlap_off() -> None:
    gradient_sync.GradientSync.begin_final = lambda self, params=None: None
    fsdp_schedule.reduce_in_backward = lambda units: None


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    buckets.BUCKET_BYTES = BUCKET_BYTES
    _record_bucket_launches()
    devices = int(os.environ["WORLD_SIZE"])
    results = {}
    for name in [*LAYOUTS, *SWITCHED_OFF]:
        if name == next(iter(SWITCHED_OFF)):
            _switch_overlap_off()
        family, arguments, trainer_arguments, batch = LAYOUTS[SWITCHED_OFF.get(name, name)]
        EVENTS.clear()
        L.seed_everything(0, verbose=False)
        probe = Probe()
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, max_steps=STEPS, callbacks=[probe], logger=False,
            strategy=HybridParallelStrategy(timeout=60, **arguments), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, **trainer_arguments,
        )  # fmt: skip
        accumulate = trainer_arguments.get("accumulate_grad_batches", 1)
        dp = devices // arguments.get("pipeline_parallel", 1)
        trainer.fit(build(family, **DEEP[family]), make_dataloader(batch, STEPS * accumulate * batch * dp))
        sync = trainer.strategy.parallelized.gradients.after_backward
        results[name] = {
            "events": list(EVENTS),
            "buckets": [len(r.buckets) for r in sync.overlapped] if sync is not None else [],
            # every overlapped gradient once: this rank's part of each (its local shard)
            "bucket_bytes": sum(_local_bytes(p) for r in sync.overlapped for p in r.parameters)
            if sync
            else 0,
            "units": probe.units,
            "unit_bytes": probe.unit_bytes,
            "accumulate": accumulate,
            "steps": STEPS,
        }
    (out_dir / f"overlap_collectives.rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
