"""Worker processes forked from one pre-imported server instead of a fresh interpreter each.

Every rank of every multi-process test used to be a new ``python``: about 9 s of CPU importing
torch, Lightning, transformers and this project before its first line ran, most of the suite's
time on a 2-core machine (a 4-rank launch paid ~20 s of wall time before training a step). The
standard library already has the cure: ``multiprocessing``'s fork server, started once with
:data:`PRELOAD` imported, forks each worker from that warm state. Forking is safe because the
server only imports: no torch operation, process group or thread exists in it.

A worker then becomes exactly what ``subprocess.Popen(argv, env=env, cwd=cwd,
start_new_session=True)`` would have started (:func:`_become`): its own session, the given
environment and working directory, stdout and stderr in the log file, ``argv`` (``-m module``,
``-c code`` or a script path) run as ``__main__``. :class:`WarmProcess` gives the launchers the
part of ``Popen``'s interface they use.

``LP_TESTS_COLD_START=1`` falls back to plain ``subprocess.Popen`` (to rule this module out).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import subprocess
import sys
import time
from multiprocessing import forkserver
from pathlib import Path

from tests.environment import without_launcher

# What every worker imports anyway; deepspeed and the Hugging Face classes the model families use too.
PRELOAD = [
    "torch",
    "lightning",
    "lightning_parallel",
    "tests.distributed.worker",
    "deepspeed",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
]


class WarmProcess:
    """A forked worker, with the part of ``Popen``'s interface the launchers use."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N when killed by signal N, as Popen

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout or 0.0)
        return self.returncode


def _become(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked child: turn into the process ``Popen`` would have started, and run it."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=True, line_buffering=True)  # noqa: SIM115
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True, line_buffering=True)  # noqa: SIM115
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - what python -c does
        else:
            sys.argv = argv
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` does
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # multiprocessing's child exit skips them; an interpreter's would not


def _start_server(env: dict[str, str]) -> multiprocessing.context.BaseContext:
    """The fork server, started with ``env`` minus the worker's ranks (it inherits ``os.environ`` at its
    start), then the imports: variables read at import time (OMP_NUM_THREADS, the Hugging Face offline
    flags) are those of :func:`tests.environment.worker_environment`, the same for every launcher."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(without_launcher(env))
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


_CONTEXT: multiprocessing.context.BaseContext | None = None


def warm_context() -> multiprocessing.context.BaseContext:
    """The fork server's context, started (with the workers' environment) if it is not yet: a process forked
    from it starts with the imports done and no thread of the test process (forking pytest itself deadlocks
    when a thread, e.g. a compile pool's, holds a lock at that moment)."""
    global _CONTEXT
    if _CONTEXT is None:
        from tests.environment import worker_environment

        _CONTEXT = _start_server(worker_environment())
    return _CONTEXT


def spawn(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> WarmProcess | subprocess.Popen:
    """Start ``argv`` (``[python, "-m", module, ...]``, ``[python, "-c", code, ...]`` or ``[python, script, ...]``).

    Like ``Popen(argv, env=env, cwd=cwd, stdout=log, stderr=STDOUT, stdin=DEVNULL,
    start_new_session=True)``. ``env`` is :func:`tests.environment.worker_environment` plus the rank's
    variables, as the launchers build it.
    """
    global _CONTEXT
    plain = (
        len(argv) < 2
        or argv[0] != sys.executable
        or (argv[1].startswith("-") and argv[1] not in ("-m", "-c"))
    )
    if os.environ.get("LP_TESTS_COLD_START") == "1" or plain:
        with open(log, "ab") as out:
            return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    if _CONTEXT is None:
        _CONTEXT = _start_server(env)
    process = _CONTEXT.Process(target=_become, args=(argv[1:], env, str(cwd), str(log)))
    process.start()
    # The launchers kill a worker's process group: wait until it leads one (its first statement).
    while process.exitcode is None and _process_group(process.pid) != process.pid:
        time.sleep(0.001)
    return WarmProcess(process)


def _process_group(pid: int | None) -> int | None:
    try:
        return os.getpgid(pid)  # type: ignore[arg-type]
    except ProcessLookupError:
        return None
