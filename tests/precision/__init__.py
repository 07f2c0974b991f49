"""Tests of the precision package; ``spawn_gloo`` runs one worker function in N gloo processes.

The workers are forked from the suite's warm fork server (``tests/warm_workers.py``), not spawned: a
spawned child re-imports torch and Lightning (about 8 s each on these 2-core machines); a forked one
inherits them. Not forked from pytest itself: a thread of the test process (a compile pool's, left by
an earlier test) holding a lock at the fork left a child deadlocked (seen twice in full runs).
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, worker: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # A short timeout: a rank that fails leaves the others blocked in a collective at most this long.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        worker(rank, world_size, *args)
    except BaseException:
        # mp.spawn reports only the first rank to fail, often a victim of another rank's crash.
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def spawn_gloo(worker: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``worker(rank, world_size, *args)`` on every rank; raises if any rank raised."""
    from tests.warm_workers import warm_context

    warm_context()  # the fork server torch's "forkserver" start method then uses
    mp.start_processes(
        _entry,
        args=(world_size, _free_port(), worker, args),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )
