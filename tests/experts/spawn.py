"""Run a function on N CPU processes over a raw gloo process group (no Lightning), for the EP tests.

    run_ranks(worker_fn, world_size=2, args=(...))   # raises AssertionError with every rank's traceback

``worker_fn(rank, world_size, *args)`` must be importable (module level); it runs after
``init_process_group`` (``file://`` rendezvous in a fresh temp dir: no port to race for, 60 s
collective timeout) with one torch thread. A rank that raises, hangs past ``timeout_s`` or dies
fails the call, and every process is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _entry(fn: Callable, rank: int, world_size: int, init_file: str, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))  # fmt: skip
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None, value))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, traceback.format_exc(), None))


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout_s: float = 120.0) -> list[Any]:
    """Return value of ``fn`` per rank; ``AssertionError`` listing each failed rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="lp-ep-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_file, args, results), daemon=True)
                 for r in range(world_size)]  # fmt: skip
        env = {"OMP_NUM_THREADS": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for p in procs:
                p.start()
            outcome: dict[int, tuple[str | None, Any]] = {}
            try:
                for _ in range(world_size):
                    rank, error, value = results.get(timeout=timeout_s)
                    outcome[rank] = (error, value)
            except Exception:  # queue.Empty: a rank hung or died without reporting
                pass
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            for p in procs:
                if p.pid is None:
                    continue
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = [f"rank {r}: {'no result (hung or died)' if r not in outcome else outcome[r][0]}"
                for r in range(world_size) if r not in outcome or outcome[r][0]]  # fmt: skip
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome[r][1] for r in range(world_size)]
