"""Worker processes started from one pre-imported parent instead of a fresh interpreter each.

Every rank of every multi-process test used to be a new ``python``: about 9 s of CPU importing
torch, Lightning, transformers and this project before its first line ran, most of the suite's
time on a 2-core machine (a 4-rank launch paid ~20 s of wall time before training a step). Here
one server process (``python -m tests.warm_workers``, started on first use with the workers'
clean environment) imports all of that once; each worker is an ``os.fork()`` of it that then
becomes exactly what ``subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)`` would
have started: its own session, the given environment and working directory, stdout and stderr
in the log file, and ``argv`` run as ``__main__`` (``-m module`` or a script path) through
:mod:`runpy`.

Forking is safe because the server never runs a torch operation, opens a process group or starts
a thread: it only imports, then waits for requests. :class:`WarmProcess` is the parent's handle,
with the part of ``Popen``'s interface the launchers use (``pid``, ``poll``, ``wait``,
``returncode``): the worker is the server's child, so the server reaps it and writes its exit
status (``Popen``'s convention: ``-N`` when killed by signal N) to a file the handle reads.

``LP_TESTS_COLD_START=1`` falls back to plain ``subprocess.Popen`` (to rule this module out).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What every worker imports anyway; deepspeed and the Hugging Face classes the model families use too.
PRELOAD = (
    "torch",
    "lightning",
    "lightning_parallel",
    "tests.distributed.worker",
    "deepspeed",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
)
# Set per worker by the launchers; read at run time only, so the server need not have them.
_PER_WORKER = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
               "LP_HARNESS_LAUNCH_TIME"}  # fmt: skip


class WarmProcess:
    """The parent's handle on a worker forked by the server (a ``Popen``-like subset)."""

    def __init__(self, pid: int, status_file: Path, server: subprocess.Popen) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status_file = status_file
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None and self._status_file.exists():
            self.returncode = int(self._status_file.read_text())
        elif (
            self.returncode is None
            and self._server.poll() is not None
            and not Path(f"/proc/{self.pid}").exists()
        ):
            self.returncode = (
                -signal.SIGKILL
            )  # the server died first: nobody will write the status; assume killed
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class _Server:
    """The pytest process's connection to the server; one per pytest process, started lazily."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lp-warm-"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_workers"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=open(self.dir / "server.log", "wb"), start_new_session=True,  # noqa: SIM115
        )  # fmt: skip
        self.lock = threading.Lock()
        self.count = 0
        if self._read() != {"ready": True}:
            raise RuntimeError(
                f"the warm worker server did not start: {(self.dir / 'server.log').read_text()}"
            )

    def _read(self) -> dict:
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(
                f"the warm worker server died: {(self.dir / 'server.log').read_text()[-4000:]}"
            )
        return json.loads(line)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> WarmProcess:
        with self.lock:
            self.count += 1
            status = self.dir / f"status.{self.count}"
            request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log), "status": str(status)}
            self.process.stdin.write((json.dumps(request) + "\n").encode())  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            return WarmProcess(self._read()["pid"], status, self.process)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


_SERVER: _Server | None = None


def spawn(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> WarmProcess | subprocess.Popen:
    """Start ``argv`` (``[python, "-m", module, ...]``, ``[python, "-c", code, ...]`` or ``[python, script, ...]``).

    Like ``Popen(argv, env=env, cwd=cwd, stdout=log, stderr=STDOUT, stdin=DEVNULL,
    start_new_session=True)``. The server starts with the first worker's environment minus its
    rank variables; every worker must share the variables read at import time (OMP_NUM_THREADS,
    the Hugging Face offline flags), which the launchers' clean environments do.
    """
    global _SERVER
    plain = (
        len(argv) < 2
        or argv[0] != sys.executable
        or (argv[1].startswith("-") and argv[1] not in ("-m", "-c"))
    )
    if os.environ.get("LP_TESTS_COLD_START") == "1" or plain:
        with open(log, "ab") as out:
            return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    if _SERVER is None or _SERVER.process.poll() is not None:
        server_env = {k: v for k, v in env.items() if k not in _PER_WORKER}
        server_env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        _SERVER = _Server(server_env)
        atexit.register(_SERVER.close)
    return _SERVER.spawn(argv, env, cwd, log)


# ----------------------------------------------------------------------------- the server side


def _become_worker(request: dict, ready_fd: int) -> None:
    """In the forked child: turn into the process ``Popen`` would have started, run it, exit."""
    code = 1
    try:
        os.setsid()
        os.write(ready_fd, b"1")  # the parent may now signal our process group
        os.close(ready_fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=True, line_buffering=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True, line_buffering=True)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        argv = request["argv"][1:]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - what python -c does
        else:
            sys.argv = argv
            sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python script.py` does
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - report like the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _write_status(path: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    Path(path + ".tmp").write_text(str(code))
    os.replace(path + ".tmp", path)


def _serve() -> None:
    # Replies go to the pipe on fd 1; anything the imports print goes to the server's log instead.
    reply = open(os.dup(1), "wb")  # noqa: SIM115 - the server's lifetime
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    for module in PRELOAD:
        __import__(module)
    reply.write(b'{"ready": true}\n')
    reply.flush()
    children: dict[int, str] = {}  # pid -> status file
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        if readable:
            line = requests.readline()
            if not line:
                return  # the pytest process is gone or done: the workers it started are its business
            request = json.loads(line)
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                _become_worker(request, ready_w)
            os.close(ready_w)
            os.read(ready_r, 1)  # after its setsid: killpg(pid) reaches it from now on
            os.close(ready_r)
            children[pid] = request["status"]
            reply.write((json.dumps({"pid": pid}) + "\n").encode())
            reply.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                _write_status(children.pop(pid), status)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in pytest: the launchers kill the workers
    _serve()
