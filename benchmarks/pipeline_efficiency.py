"""Pipeline efficiency: one process without pipelining vs 2 pipeline ranks, same global batch.

    python -m benchmarks.pipeline_efficiency                         # 1F1B, M = 2, 4, 8, 16
    python -m benchmarks.pipeline_efficiency --schedules gpipe 1f1b interleaved_1f1b zbv
    python -m benchmarks.pipeline_efficiency --micro-batches 8 --timeline docs/images   # + the timeline PNG

**Efficiency** = (single-process step time) / (P x pipelined step time): the share of the P
ranks' time that does the work one rank would do alone. It is printed beside the schedule's
ideal (``lightning_parallel.pipeline.schedules.ideal_efficiency``: M / (M + P - 1) for GPipe and
1F1B, the bubble shrunk V times for interleaved schedules, 1 for the zero-bubble ones), which
counts only the bubble; the measured value also pays for the point-to-point transfers, the
head and loss on the last stage (imbalance), the kernels at micro-batch size (smaller matrix
products; each micro-batch's weight gradients added into ``.grad``) and the Python work per
micro-batch (the user's step runs once per micro-batch on every stage).

How it is measured. The script starts 2 ranks itself (``common.launch``, one torch thread
each). For every schedule and micro-batch count M, both ranks run the pipelined ``Trainer``
(``HybridParallelStrategy(pipeline_parallel=2, micro_batches=M, pipeline_schedule=...)``) and
rank 0 also runs the single-process reference ``Trainer`` (one device, one thread, the same
model, weights and global batch) in a second thread; their training steps alternate one by one
(``common.Baton``: pipelined step, reference step, pipelined step, ...), so load from elsewhere
on the machine hits both alike. While rank 0 runs a reference step, rank 1 waits in a barrier
(blocked, not spinning). A callback times each step from ``on_train_batch_start`` to
``on_train_batch_end`` (forward, backward and optimizer step), with a barrier over the pipeline
at both ends of a pipelined step so that it is the step of the whole pipeline; the first
``--warmup`` steps (torch's shape inference, allocator warm-up) are not timed. The efficiency is
the median over the back-to-back pairs of ``reference[i] / (P x pipelined[i])``.

The **CPU work ratio** is the same quotient in CPU seconds (``time.process_time``; the ranks'
CPU seconds summed): reference / pipeline. Ranks that wait for each other are blocked in gloo,
not spinning, so this counts only the extra *work* of pipelining (kernels at micro-batch size,
per-micro-batch Python, transfers, Lightning's step on every rank), and it moves much less
than wall time when other jobs load the machine. On a quiet machine efficiency ~ ideal x work ratio; well below that, the
ranks waited for more than the bubble (the transfers, or a core taken by another job: a
pipeline needs all its P cores at once, the reference one, so load hurts the pipeline more).

Micro-batches have a fixed size (``--micro-batch-size`` sequences; global batch = M x that) so
that a micro-batch costs the same at every M, as the ideal formula assumes; ``--batch-size``
fixes the global batch instead (micro-batches then shrink as M grows: the usual trade-off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Baton,
    finish_worker,
    init_process_group,
    launch,
    launch_env,
    machine,
    quiet_lightning,
    recipe_data,
    recipe_model,
    run_lockstep,
    table,
)

PIPELINE_PARALLEL = 2
SHAPES = {
    # Tests: runs in seconds, timings meaningless (transfers and Python overhead dominate).
    "tiny": dict(n_layer=4, n_head=2, n_embd=32, block_size=16),
    # The measurement: 8 blocks of width 256 (6.4M parameters), T=128: a micro-batch of 2
    # sequences is ~40 ms of forward and ~80 ms of backward per stage on one core, against
    # under 1 ms for sending its 256 KB activation: compute dominates communication.
    "default": dict(n_layer=8, n_head=4, n_embd=256, block_size=128),
}
DEFAULT_MICRO_BATCHES = (2, 4, 8, 16)
TARGET = 0.9  # measured / ideal, for M >= 8 (the target)


# ---- timing --------------------------------------------------------------------------------


def PairedStepTimer(baton: Baton, name: str, warmup: int, group: Any = None, every: int = 1) -> Any:  # noqa: N802
    """Callback: pass ``baton`` on before every step, then time the step (barriers on ``group`` at both ends).

    ``every``: pass it on before every ``every``-th batch only (the batches of one accumulated step run together).

    A factory so that Lightning is imported lazily (as in ``common.StepTimer``).
    """
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class _PairedStepTimer(Callback):
        def __init__(self) -> None:
            self.times: dict[str, list[float]] = {"wall": [], "cpu": []}
            self._seen = 0
            self._start = (0.0, 0.0)

        def _barrier(self) -> None:
            if group is not None:
                dist.barrier(group=group)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % every == 0:
                baton.pass_on(name)
            self._barrier()
            self._start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self._barrier()
            wall, cpu = time.perf_counter() - self._start[0], time.process_time() - self._start[1]
            self._seen += 1
            if self._seen > warmup:
                self.times["wall"].append(wall)
                self.times["cpu"].append(cpu)

    return _PairedStepTimer()


def _trainer(devices: int, strategy: Any, steps: int, callbacks: list[Any], **extra: Any) -> Any:
    import lightning as L

    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, **extra,
    )  # fmt: skip


def _model(shape: dict[str, Any]) -> Any:
    return recipe_model(seed=1234, **shape)


def _run_pipelined(
    schedule: str, micro_batches: int, batch: int, shape: dict[str, Any], data: Any, args: argparse.Namespace,
    baton: Baton, timeline: Path | None,
) -> dict[str, list[float]]:  # fmt: skip
    import torch.distributed as dist

    from lightning_parallel import HybridParallelStrategy

    timer = PairedStepTimer(baton, "pipelined", args.warmup, group=dist.group.WORLD)
    callbacks = [timer]
    if timeline is not None:
        from lightning_parallel.pipeline.timeline import PipelineTimeline

        # Record a timed step (after the warm-up): the picture shows what the table measured.
        callbacks.append(
            PipelineTimeline(
                step=args.warmup + 1, path=timeline, json_path=args.out / f"{timeline.stem}.json"
            )
        )
    strategy = HybridParallelStrategy(
        pipeline_parallel=PIPELINE_PARALLEL,
        micro_batches=micro_batches,
        pipeline_schedule=schedule,
        timeout=300,
    )
    trainer = _trainer(PIPELINE_PARALLEL, strategy, args.warmup + args.steps, callbacks)
    trainer.fit(_model(shape), datamodule=recipe_data(shape["block_size"], batch, like=data))
    return timer.times


def _run_reference(
    batch: int, shape: dict[str, Any], data: Any, args: argparse.Namespace, baton: Baton
) -> dict[str, list[float]]:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    timer = PairedStepTimer(baton, "reference", args.warmup)
    # An explicit single-device strategy: the rank's RANK/WORLD_SIZE variables must not make
    # Lightning treat this Trainer as part of the 2-process job.
    trainer = _trainer(1, SingleDeviceStrategy(torch.device("cpu")), args.warmup + args.steps, [timer])
    trainer.fit(_model(shape), datamodule=recipe_data(shape["block_size"], batch, like=data))
    return timer.times


def _run_accumulated(
    micro_batches: int, batch: int, shape: dict[str, Any], data: Any, args: argparse.Namespace, baton: Baton
) -> dict[str, list[float]]:
    """One process over the same micro-batches, one after the other (gradient accumulation): what cutting the
    batch into micro-batches costs without any pipeline. Times per optimizer step (its ``M`` batches summed)."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    timer = PairedStepTimer(baton, "accumulated", args.warmup * micro_batches, every=micro_batches)
    strategy = SingleDeviceStrategy(torch.device("cpu"))
    trainer = _trainer(1, strategy, args.warmup + args.steps, [timer], accumulate_grad_batches=micro_batches)
    trainer.fit(_model(shape), datamodule=recipe_data(shape["block_size"], batch // micro_batches, like=data))
    return {
        key: [
            sum(values[i : i + micro_batches])
            for i in range(0, len(values) - micro_batches + 1, micro_batches)
        ]
        for key, values in timer.times.items()
    }


HAND_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # what benchmarks/hand_pipeline.py drives


def _run_hand(
    schedule: str, micro_batches: int, batch: int, shape: dict[str, Any], data: Any, args: argparse.Namespace,
    baton: Baton,
) -> dict[str, list[float]]:  # fmt: skip
    """The same stages cut by hand and driven with torch's schedule under ``ModelParallelStrategy``."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from benchmarks.hand_pipeline import hand_pipeline_model

    timer = PairedStepTimer(baton, "hand", args.warmup, group=dist.group.WORLD)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=PIPELINE_PARALLEL)
    trainer = _trainer(PIPELINE_PARALLEL, strategy, args.warmup + args.steps, [timer])
    model = hand_pipeline_model(schedule, micro_batches, seed=1234, **shape)
    trainer.fit(model, datamodule=recipe_data(shape["block_size"], batch, like=data))
    return timer.times


def global_batch(micro_batches: int, args: argparse.Namespace) -> int:
    """Sequences per optimizer step: fixed (``--batch-size``) or M x ``--micro-batch-size``."""
    return args.batch_size if args.batch_size else micro_batches * args.micro_batch_size


def worker(args: argparse.Namespace) -> None:
    """One rank: every (schedule, M) pair in turn; rank 0 writes every step time to ``--out``."""
    import torch.distributed as dist

    from lightning_parallel.config.arguments import check_micro_batches, resolve_schedule

    quiet_lightning()
    torch.set_num_threads(1)
    dist_env = launch_env()
    rank = init_process_group(timeout_s=300)
    shape = SHAPES[args.shape]
    biggest = max(global_batch(m, args) for m in args.micro_batches)
    # Random tokens: decoding the corpus takes seconds and timing needs only the shapes.
    windows = (args.warmup + args.steps + 2) * biggest
    data = recipe_data(shape["block_size"], biggest, random_tokens=windows * shape["block_size"] + 1)
    data.setup("fit")
    results: list[dict[str, Any]] = []
    start, start_load = time.perf_counter(), os.getloadavg()[0]
    for schedule in args.schedules:
        spec = resolve_schedule(schedule)
        for m in args.micro_batches:
            row: dict[str, Any] = {"schedule": spec.name, "micro_batches": m, "batch": global_batch(m, args)}
            try:
                check_micro_batches(spec, m, PIPELINE_PARALLEL)
                if row["batch"] % m:
                    raise ValueError(f"the global batch {row['batch']} is not a multiple of M={m}")
            except ValueError as error:
                row["skipped"] = str(error)
                results.append(row)
                continue
            os.environ.update(dist_env)  # Lightning's environment deletes WORLD_SIZE at teardown
            timeline = None
            if args.timeline is not None and m == args.timeline_micro_batches:
                timeline = args.timeline / f"pipeline_timeline_{spec.name}.png"
            runs = {
                "pipelined": lambda baton, _n, s=spec.name, m=m, b=row["batch"], t=timeline: _run_pipelined(
                    s, m, b, shape, data, args, baton, t
                )
            }
            if args.hand and spec.name in HAND_SCHEDULES:
                runs["hand"] = lambda baton, _n, s=spec.name, m=m, b=row["batch"]: _run_hand(
                    s, m, b, shape, data, args, baton
                )
            if rank == 0:
                runs["reference"] = lambda baton, _n, b=row["batch"]: _run_reference(
                    b, shape, data, args, baton
                )
            if rank == 0 and args.hand:
                runs["accumulated"] = lambda baton, _n, m=m, b=row["batch"]: _run_accumulated(
                    m, b, shape, data, args, baton
                )
            measured = run_lockstep(runs)  # type: ignore[arg-type]
            # CPU seconds of every rank (a rank waiting for another is blocked, not spinning:
            # their sum is the work the pipeline did, whatever the load on the machine).
            cpu: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(cpu, measured["pipelined"]["cpu"])
            if rank == 0:
                row.update(
                    reference=measured["reference"], pipelined={**measured["pipelined"], "cpu_ranks": cpu}
                )
                row.update({k: measured[k] for k in ("hand", "accumulated") if k in measured})
                if timeline is not None and (args.out / f"{timeline.stem}.json").exists():
                    row["bubble_fraction"] = json.loads((args.out / f"{timeline.stem}.json").read_text())[
                        "bubble_fraction"
                    ]
                results.append(row)
                print(_line(row), flush=True)
    if rank == 0:
        payload = {"results": results, "seconds": time.perf_counter() - start, "shape": shape,
                   "load_average": (start_load, os.getloadavg()[0])}  # fmt: skip
        (args.out / "pipeline_efficiency.json").write_text(json.dumps(payload))
    finish_worker()


# ---- results -------------------------------------------------------------------------------


def summarize(row: dict[str, Any], pipeline_parallel: int = PIPELINE_PARALLEL) -> dict[str, Any]:
    """Step times of one (schedule, M) -> medians, efficiency (median of paired ratios, quartiles), ideal."""
    from lightning_parallel.config.arguments import resolve_schedule, virtual_stages_for
    from lightning_parallel.pipeline.schedules import ideal_efficiency

    spec = resolve_schedule(row["schedule"])
    ideal = ideal_efficiency(spec, row["micro_batches"], pipeline_parallel, virtual_stages_for(spec, None))
    out = {
        "schedule": spec.name,
        "micro_batches": row["micro_batches"],
        "batch": row["batch"],
        "ideal": ideal,
    }
    if "skipped" in row:
        return {**out, "skipped": row["skipped"]}
    ref, pipe = row["reference"]["wall"], row["pipelined"]["wall"]
    pairs = [r / (pipeline_parallel * p) for r, p in zip(ref, pipe, strict=False)]
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    efficiency = statistics.median(pairs)
    # Work: reference CPU seconds / the CPU seconds all ranks spent on the same step.
    work = [
        r / sum(ranks)
        for r, *ranks in zip(row["reference"]["cpu"], *row["pipelined"]["cpu_ranks"], strict=False)
    ]
    hand = ceiling = None
    if "accumulated" in row:  # whole batch / the same batch as M micro-batches in one process
        ceiling = statistics.median(r / a for r, a in zip(ref, row["accumulated"]["wall"], strict=False))
    if "hand" in row:  # the hand-driven pipeline's efficiency, against the same reference steps
        hand = (
            statistics.median(
                r / (pipeline_parallel * h) for r, h in zip(ref, row["hand"]["wall"], strict=False)
            )
            / ideal
        )
    return {
        **out, "reference_s": statistics.median(ref), "pipelined_s": statistics.median(pipe), "pairs": len(pairs),
        "efficiency": efficiency, "q1": quartiles[0], "q3": quartiles[2], "of_ideal": efficiency / ideal,
        "work": statistics.median(work), "bubble_fraction": row.get("bubble_fraction"), "hand_of_ideal": hand,
        "micro_batch_ceiling": ceiling,
    }  # fmt: skip


def _line(row: dict[str, Any]) -> str:
    s = summarize(row)
    return (f"{s['schedule']} M={s['micro_batches']}: reference {s['reference_s'] * 1e3:.0f} ms, pipelined"
            f" {s['pipelined_s'] * 1e3:.0f} ms, efficiency {s['efficiency']:.3f} (ideal {s['ideal']:.3f})")  # fmt: skip


def measure(
    schedules: tuple[str, ...] = ("1f1b",), micro_batches: tuple[int, ...] = DEFAULT_MICRO_BATCHES,
    shape: str = "default", steps: int = 8, warmup: int = 2, micro_batch_size: int = 2,
    batch_size: int | None = None, timeline: Path | None = None, timeline_micro_batches: int = 8,
    timeout_s: float = 3600.0, hand: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Launch the 2 ranks, measure every (schedule, M); rank 0's payload with :func:`summarize` rows added."""
    forwarded = ["--worker", "--shape", shape, "--steps", str(steps), "--warmup", str(warmup),
                 "--micro-batch-size", str(micro_batch_size), "--schedules", *schedules,
                 "--micro-batches", *map(str, micro_batches), "--timeline-micro-batches", str(timeline_micro_batches)]  # fmt: skip
    if batch_size:
        forwarded += ["--batch-size", str(batch_size)]
    if hand:
        forwarded.append("--hand")
    if timeline is not None:
        forwarded += ["--timeline", str(Path(timeline).resolve())]
    out = launch("benchmarks.pipeline_efficiency", forwarded, nprocs=PIPELINE_PARALLEL, timeout_s=timeout_s)
    payload = json.loads((out / "pipeline_efficiency.json").read_text())
    payload["rows"] = [summarize(r) for r in payload["results"]]
    return payload


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(payload: dict[str, Any]) -> str:
    """The table, as printed (and pasted into the README)."""
    rows = []
    hand = any(s.get("hand_of_ideal") is not None for s in payload["rows"])
    for s in payload["rows"]:
        label = [s["schedule"], s["micro_batches"], s["batch"]]
        if "skipped" in s:
            rows.append(
                [*label, "-", "-", "-", f"{s['ideal']:.3f}", "n/a (needs more micro-batches)", "-"]
                + ["-", "-"] * hand
            )
            continue
        verdict = ""
        if s["micro_batches"] >= 8:
            verdict = " (meets >= 0.9)" if s["of_ideal"] >= TARGET else " (MISSES >= 0.9)"
        rows.append([
            *label, f"{s['reference_s'] * 1e3:.0f} ms", f"{s['pipelined_s'] * 1e3:.0f} ms",
            f"{s['efficiency']:.3f} ({s['q1']:.2f}-{s['q3']:.2f})", f"{s['ideal']:.3f}", f"{s['of_ideal']:.3f}{verdict}",
            f"{s['work']:.3f}",
        ] + ([_maybe(s["hand_of_ideal"]), _maybe(s["micro_batch_ceiling"])] if hand else []))  # fmt: skip
    text = table(["schedule", "M", "batch", "1 process", f"P={PIPELINE_PARALLEL} pipelined",
                  "efficiency (quartiles)", "ideal", "measured / ideal", "CPU work ratio"]
                 + (["by hand: measured / ideal", "1 process, whole batch / M micro-batches"] if hand else []),
                 rows)  # fmt: skip
    bubbles = [f"{s['schedule']} M={s['micro_batches']}: {s['bubble_fraction']:.1%}" for s in payload["rows"]
               if s.get("bubble_fraction") is not None]  # fmt: skip
    if bubbles:
        text += "\nbubble fraction of the recorded timeline step (PipelineTimeline): " + ", ".join(bubbles)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["1f1b"], help="schedule names (default: 1f1b)")
    parser.add_argument(
        "--micro-batches", nargs="+", type=int, default=list(DEFAULT_MICRO_BATCHES), help="values of M"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per (schedule, M)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each run")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--batch-size", type=int, default=0, help="fix the global batch instead (sequences)")
    parser.add_argument(
        "--timeline", type=Path, help="folder: draw the PipelineTimeline of one step at M=8 there"
    )
    parser.add_argument(
        "--hand",
        action="store_true",
        help="also the same stages cut and driven by hand (benchmarks/hand_pipeline.py), and one process over the"
        " same micro-batches (what the smaller kernels alone cost)",
    )
    parser.add_argument("--timeline-micro-batches", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    payload = measure(tuple(args.schedules), tuple(args.micro_batches), args.shape, args.steps, args.warmup,
                      args.micro_batch_size, args.batch_size or None, args.timeline, args.timeline_micro_batches,
                      hand=args.hand)  # fmt: skip
    batch = (
        f"global batch {args.batch_size}"
        if args.batch_size
        else f"micro-batches of {args.micro_batch_size} sequences"
    )
    print(f"\n# {machine()}; P={PIPELINE_PARALLEL} ranks x 1 torch thread (reference: 1 process x 1 thread), gloo;"
          f" load average {payload['load_average'][0]:.1f} at the start, {payload['load_average'][1]:.1f} at the end")  # fmt: skip
    print(f"# recipe GPT {payload['shape']}, {batch}; {args.steps} timed steps (+{args.warmup} warm-up) per row,"
          f" pipelined and reference steps interleaved; {payload['seconds']:.0f} s\n")  # fmt: skip
    print(report(payload))


if __name__ == "__main__":
    main()
