"""Tests of the strategy through the real Trainer.

Multi-process cases never run a distributed Trainer inside pytest (Lightning would re-launch
the pytest command line as the other ranks). :func:`launch` starts one ``python script.py``
per rank with the environment a launcher such as torchrun sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning sees processes created
externally, and reports every rank's exit code and output. A rank that fails gives the others
``grace_s`` to fail on their own (they should: errors are raised on every rank alike) before
they are killed, and everything is killed at ``timeout_s``; nothing is left running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.environment import release_build_locks, worker_environment
from tests.warm_workers import WarmProcess, spawn

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed by the launcher
    output: str  # stdout and stderr together
    killed: bool
    leftover: bool  # something of this rank's session was still alive after it exited


@dataclass
class Launch:
    ranks: list[RankResult]
    wall_s: float

    def summary(self) -> str:
        return "\n".join(
            f"--- rank {r.rank}: returncode={r.returncode} killed={r.killed} leftover={r.leftover}\n"
            f"{r.output[-4000:]}"
            for r in self.ranks
        )

    def assert_all_succeeded(self) -> None:
        if any(r.returncode != 0 for r in self.ranks):
            raise AssertionError("a rank failed:\n" + self.summary())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _session_alive(process: WarmProcess | subprocess.Popen) -> bool:
    try:
        os.killpg(process.pid, 0)  # each rank leads its own session and process group
    except ProcessLookupError:
        return False
    return True


def _kill(process: WarmProcess | subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the rank and anything it started (its own session)
    except ProcessLookupError:
        process.wait()
        return
    process.wait()
    release_build_locks()


def launch(
    script: str,
    args: list[str],
    tmp_path: Path,
    world_size: int = 2,
    timeout_s: float = 120,
    grace_s: float = 30,
) -> Launch:
    """Run ``tests/strategy/scripts/<script>`` on ``world_size`` ranks; wait for all of them."""
    port = _free_port()
    base_env = {**worker_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "WORLD_SIZE": str(world_size)}  # fmt: skip
    processes, logs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        log_path = tmp_path / f"{Path(script).stem}.rank{rank}.log"
        log = open(log_path, "w+")  # noqa: SIM115 - closed below
        env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
        command = [sys.executable, str(SCRIPTS / script), *args]
        processes.append(spawn(command, env, ROOT, log_path))
        logs.append(log)
    killed = [False] * world_size
    first_failure: float | None = None
    try:
        while any(p.poll() is None for p in processes):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in processes):
                first_failure = now
            too_long = now - start > timeout_s or (
                first_failure is not None and now - first_failure > grace_s
            )
            if too_long:
                for rank, process in enumerate(processes):
                    if process.poll() is None:
                        killed[rank] = True
                        _kill(process)
                break
            time.sleep(0.2)
    finally:
        for rank, process in enumerate(processes):
            if process.poll() is None:  # an exception in this function: leave nothing behind
                killed[rank] = True
                _kill(process)
    wall_s = time.monotonic() - start
    results = []
    for rank, (process, log) in enumerate(zip(processes, logs, strict=True)):
        leftover = _session_alive(process)
        if leftover:
            os.killpg(process.pid, signal.SIGKILL)
            release_build_locks()
        log.seek(0)
        returncode = None if killed[rank] else process.returncode
        results.append(RankResult(rank, returncode, log.read(), killed[rank], leftover))
        log.close()
    return Launch(results, wall_s)


def launch_for_results(
    script: str, tmp_path: Path, world_size: int = 2, timeout_s: float = 800
) -> list[dict]:
    """Run ``script`` (which writes ``OUT_DIR/<name>.rank{r}.json``) with ``tmp_path`` as OUT_DIR on
    ``world_size`` ranks; every rank must succeed. Returns each rank's JSON, by rank."""
    import json

    launch(
        script, [str(tmp_path)], tmp_path, world_size=world_size, timeout_s=timeout_s
    ).assert_all_succeeded()
    name = script.removesuffix(".py")
    return [json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in range(world_size)]
