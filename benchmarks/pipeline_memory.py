"""Peak activation memory per pipeline stage: 1F1B vs GPipe, counted in bytes (not timed).

    python -m benchmarks.pipeline_memory                     # P=2, M=16, 1f1b and gpipe
    python -m benchmarks.pipeline_memory --micro-batches 8 --schedules 1f1b gpipe interleaved_1f1b

What a schedule changes is how many micro-batches' activations a stage holds at once: GPipe
runs every forward before any backward, so a stage holds all M; 1F1B starts backward as soon
as the last stage can, so stage s holds at most P - s (at most P: the pipeline's depth).

How it is counted. During one training step (``--step``, after torch's shape inference), on
each rank, every stage in ``trainer.strategy.pipeline_stages`` has its ``forward_one_chunk``
wrapped (as ``PipelineTimeline`` wraps it) in ``torch.autograd.graph.saved_tensors_hooks``.
The pack hook wraps each tensor autograd saves for backward in a small holder that adds the
bytes of the tensor's storage to a live counter and subtracts them when autograd drops it
(``__del__``: backward releases what it saved), and the peak of the counter is kept per stage
and per rank. The bytes counted for one micro-batch are the growth of the counter during its
forward.

- A storage is counted once, however many saved tensors view it (q, k and v are views of one
  projection output; ``linear`` saves ``weight.t()``, a view of the weight).
- Not counted: parameters (autograd saves weights too) and the batch (micro-batches are views of
  it). The received activation of a later stage is counted with its micro-batch (the first block's
  norm saves it): the strategy makes it when the receive is posted and lets it go after the
  micro-batch's backward (``pipeline/receive_buffers.py``; torch's own stage kept M buffers for the
  whole run). The most bytes of receive buffers a stage held at once are listed separately.
- Not seen by the hooks: the stage's output, which torch keeps per micro-batch until its
  backward (one hidden state per micro-batch in flight; small beside the saved tensors).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from benchmarks.common import (
    finish_worker,
    init_process_group,
    launch,
    launch_env,
    machine,
    quiet_lightning,
    recipe_data,
    recipe_model,
    table,
)
from benchmarks.pipeline_efficiency import PIPELINE_PARALLEL, SHAPES
from lightning_parallel.pipeline.receive_buffers import receive_buffer_bytes

DEFAULT_MICRO_BATCHES = 16


# ---- counting ------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = _local(tensor).untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedTensorCounter:
    """Live and peak bytes of the storages autograd holds for backward, per stage and in total.

    ``excluded`` storages (parameters, the batch, torch's receive buffers) are never counted.
    """

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.live: dict[int, int] = defaultdict(int)  # stage -> bytes
        self.peak: dict[int, int] = defaultdict(int)
        self.total = 0
        self.total_peak = 0
        self.per_micro_batch: dict[int, list[int]] = defaultdict(list)  # stage -> growth of each forward
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes, stage]

    def pack(self, stage: int, tensor: torch.Tensor) -> Any:
        pointer, nbytes = _storage_key(tensor)
        if pointer in self.excluded or nbytes == 0:
            return tensor
        return _Held(tensor.detach(), self, pointer, nbytes, stage)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def acquire(self, pointer: int, nbytes: int, stage: int) -> None:
        entry = self._refs.get(pointer)
        if entry is not None:
            entry[0] += 1
            return
        self._refs[pointer] = [1, nbytes, stage]
        self.live[stage] += nbytes
        self.peak[stage] = max(self.peak[stage], self.live[stage])
        self.total += nbytes
        self.total_peak = max(self.total_peak, self.total)

    def release(self, pointer: int) -> None:
        entry = self._refs[pointer]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[pointer]
            self.live[entry[2]] -= entry[1]
            self.total -= entry[1]


class _Held:
    """What autograd stores instead of a saved tensor: the tensor, counted while this object lives.

    The tensor is kept detached: a saved *output* of an operation would otherwise reference its
    own ``grad_fn``, which references this holder: a cycle that only the garbage collector
    frees, late, and the counter would never see the memory released.
    """

    __slots__ = ("tensor", "counter", "pointer")

    def __init__(
        self, tensor: torch.Tensor, counter: SavedTensorCounter, pointer: int, nbytes: int, stage: int
    ):
        self.tensor = tensor
        self.counter = counter
        self.pointer = pointer
        counter.acquire(pointer, nbytes, stage)

    def __del__(self) -> None:
        self.counter.release(self.pointer)


def _storages(value: Any) -> set[int]:
    """Storage pointers of every tensor in a (nested) batch."""
    if isinstance(value, torch.Tensor):
        return {_storage_key(value)[0]}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    return set()


def receive_buffers(stage: Any) -> int:
    """Most bytes of receive buffers ``stage`` held at once: as many as the schedule had receives outstanding
    or micro-batches in flight (``pipeline/receive_buffers.py``); torch's own stage: one per micro-batch."""
    pool = stage.receive_buffers
    return pool.peak_bytes if pool.enabled else receive_buffer_bytes(stage)


def ActivationMemory(step: int) -> Any:  # noqa: N802 (a factory: Lightning is imported lazily)
    """Callback: count saved-for-backward bytes per stage during training step ``step`` on this rank."""
    from lightning.pytorch.callbacks import Callback

    class _ActivationMemory(Callback):
        def __init__(self) -> None:
            self.counter: SavedTensorCounter | None = None
            self.result: dict[str, Any] | None = None
            self._saved: list[Any] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != step or self.counter is not None:
                return
            stages = list(trainer.strategy.pipeline_stages)
            excluded = {_storage_key(p)[0] for p in pl_module.parameters()} | _storages(batch)
            for stage in stages:
                for recv in stage.args_recv_info.values():
                    excluded |= {
                        _storage_key(i.buffer)[0] for i in recv if getattr(i, "buffer", None) is not None
                    }
            self.counter = SavedTensorCounter(excluded)
            for stage in stages:
                # An instance attribute shadows the method for this step only (torch is not modified).
                self._saved.append(stage)
                stage.forward_one_chunk = self._wrap(stage, stage.forward_one_chunk)

        def _wrap(self, stage: Any, method: Any) -> Any:
            counter = self.counter
            assert counter is not None
            index = int(stage.stage_index)

            @functools.wraps(method)
            def counted(*args: Any, **kwargs: Any) -> Any:
                before = counter.live[index]
                with torch.autograd.graph.saved_tensors_hooks(
                    functools.partial(counter.pack, index), counter.unpack
                ):
                    output = method(*args, **kwargs)
                counter.per_micro_batch[index].append(counter.live[index] - before)
                return output

            return counted

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            counter = self.counter
            if counter is None or self.result is not None:
                return
            for stage in self._saved:
                vars(stage).pop("forward_one_chunk", None)
            stages = {}
            for stage in trainer.strategy.pipeline_stages:
                index = int(stage.stage_index)
                stages[index] = {
                    "peak": counter.peak[index],
                    "per_micro_batch": counter.per_micro_batch[index],
                    "left_after_step": counter.live[index],
                    "receive_buffers": receive_buffers(stage),
                }
            self.result = {"stages": stages, "rank_peak": counter.total_peak}

    return _ActivationMemory()


# ---- running -------------------------------------------------------------------------------


def _run(
    schedule: str, micro_batches: int, batch: int, shape: dict[str, Any], data: Any, step: int
) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from lightning_parallel import HybridParallelStrategy

    callback = ActivationMemory(step)
    strategy = HybridParallelStrategy(
        pipeline_parallel=PIPELINE_PARALLEL,
        micro_batches=micro_batches,
        pipeline_schedule=schedule,
        timeout=300,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=PIPELINE_PARALLEL, strategy=strategy, max_steps=step + 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(
        recipe_model(seed=1234, **shape), datamodule=recipe_data(shape["block_size"], batch, like=data)
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, callback.result)
    stages = {int(k): v for rank_result in gathered for k, v in rank_result["stages"].items()}
    owners = {int(k): r for r, rank_result in enumerate(gathered) for k in rank_result["stages"]}
    return {"schedule": schedule, "micro_batches": micro_batches, "batch": batch, "stages": stages,
            "owners": owners, "rank_peaks": [g["rank_peak"] for g in gathered]}  # fmt: skip


def worker(args: argparse.Namespace) -> None:

    from lightning_parallel.config.arguments import resolve_schedule

    quiet_lightning()
    torch.set_num_threads(1)
    dist_env = launch_env()
    rank = init_process_group(timeout_s=300)
    shape = SHAPES[args.shape]
    batch = args.micro_batches * args.micro_batch_size
    data = recipe_data(
        shape["block_size"], batch, random_tokens=(args.step + 3) * batch * shape["block_size"] + 1
    )
    data.setup("fit")
    results = []
    for schedule in args.schedules:
        os.environ.update(dist_env)  # Lightning's environment deletes WORLD_SIZE at teardown
        results.append(
            _run(resolve_schedule(schedule).name, args.micro_batches, batch, shape, data, args.step)
        )
    if rank == 0:
        (args.out / "pipeline_memory.json").write_text(json.dumps(results))
    finish_worker()


def measure(
    schedules: tuple[str, ...] = ("1f1b", "gpipe"), micro_batches: int = DEFAULT_MICRO_BATCHES,
    shape: str = "default", micro_batch_size: int = 2, step: int = 2, timeout_s: float = 1200.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Launch the 2 ranks and count one step of each schedule; one result per schedule.

    A result has ``stages``: {stage index: {"peak", "per_micro_batch" (bytes added by each
    forward), "left_after_step", "receive_buffers"}} and ``owners``: {stage: pipeline rank}.
    """
    forwarded = ["--worker", "--shape", shape, "--micro-batches", str(micro_batches), "--step", str(step),
                 "--micro-batch-size", str(micro_batch_size), "--schedules", *schedules]  # fmt: skip
    out = launch("benchmarks.pipeline_memory", forwarded, nprocs=PIPELINE_PARALLEL, timeout_s=timeout_s)
    results = json.loads((out / "pipeline_memory.json").read_text())
    for result in results:  # JSON keys are strings
        result["stages"] = {int(k): v for k, v in result["stages"].items()}
        result["owners"] = {int(k): v for k, v in result["owners"].items()}
    return results


def expected_in_flight(schedule: str, stage: int, micro_batches: int, pipeline_parallel: int) -> int | None:
    """Micro-batches whose activations ``stage`` holds at the peak, for the single-stage schedules."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":  # torch's warm-up: num_stages - stage forwards before the first backward
        return min(micro_batches, pipeline_parallel - stage)
    return None


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def report(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        m = result["micro_batches"]
        for stage, s in sorted(result["stages"].items()):
            one = max(s["per_micro_batch"]) if s["per_micro_batch"] else 0
            expected = expected_in_flight(result["schedule"], stage, m, PIPELINE_PARALLEL)
            rows.append([
                result["schedule"], f"{stage} (rank {result['owners'][stage]})", _size(s["peak"]), _size(one),
                f"{s['peak'] / one:.2f}" if one else "-", "-" if expected is None else expected,
                _size(s["receive_buffers"]),
            ])  # fmt: skip
    return table(["schedule", "stage", "peak saved for backward", "one micro-batch", "peak / micro-batch",
                  "expected", "receive buffers (reused)"], rows)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--micro-batches", type=int, default=DEFAULT_MICRO_BATCHES, help="M")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument(
        "--step", type=int, default=2, help="the training step counted (after shape inference)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = measure(tuple(args.schedules), args.micro_batches, args.shape, args.micro_batch_size, args.step)
    print(f"# {machine()}; P={PIPELINE_PARALLEL}, M={args.micro_batches}, recipe GPT {SHAPES[args.shape]},"
          f" micro-batches of {args.micro_batch_size} sequences, fp32; training step {args.step}\n")  # fmt: skip
    print(report(results))


if __name__ == "__main__":
    main()
