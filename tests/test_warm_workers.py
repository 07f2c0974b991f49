"""A warm worker is what ``Popen(argv, env=env, cwd=cwd, start_new_session=True)`` would have started.

The launchers of every multi-process test depend on it (tests/warm_workers.py): exit status,
signals, environment, working directory, ``argv``, ``__main__``, the log, the session.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.environment import worker_environment
from tests.warm_workers import WarmProcess, spawn

# LP_TESTS_COLD_START=1 turns warm workers off (plain Popen) to rule them out: nothing to test here then.
pytestmark = pytest.mark.skipif(
    os.environ.get("LP_TESTS_COLD_START") == "1", reason="warm workers turned off"
)

ENV = {**worker_environment(), "LP_PROBE": "probe-value"}


def _run(argv: list[str], tmp_path: Path, timeout_s: float = 60) -> tuple[int, str]:
    log = tmp_path / "worker.log"
    process = spawn([sys.executable, *argv], ENV, tmp_path, log)
    assert isinstance(process, WarmProcess)
    return process.wait(timeout_s), log.read_text()


def test_exit_status_and_output_reach_the_parent(tmp_path: Path) -> None:
    code, output = _run(
        ["-c", "import sys; print('hello'); print('oops', file=sys.stderr); sys.exit(3)"], tmp_path
    )
    assert code == 3
    assert "hello" in output and "oops" in output


def test_an_uncaught_exception_exits_1_with_its_traceback(tmp_path: Path) -> None:
    code, output = _run(["-c", "raise RuntimeError('boom')"], tmp_path)
    assert code == 1
    assert "RuntimeError: boom" in output


def test_environment_directory_argv_and_session_are_the_workers_own(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'env': os.environ.get('LP_PROBE'), 'rank': os.environ.get('RANK'),\n"
        "                      'cwd': os.getcwd(), 'argv': sys.argv, 'path0': sys.path[0],\n"
        "                      'leader': os.getsid(0) == os.getpid() == os.getpgid(0)}))\n"
    )
    code, output = _run([str(script), "a", "b"], tmp_path)
    assert code == 0, output
    seen = json.loads(output.strip().splitlines()[-1])
    assert seen == {"env": "probe-value", "rank": None, "cwd": str(tmp_path), "argv": [str(script), "a", "b"],
                    "path0": str(tmp_path), "leader": True}  # fmt: skip


def test_a_module_runs_as_main(tmp_path: Path) -> None:
    code, output = _run(["-m", "json.tool", "--help"], tmp_path)
    assert code == 0 and "usage" in output


def test_killing_the_session_reports_the_signal(tmp_path: Path) -> None:
    process = spawn([sys.executable, "-c", "import time; time.sleep(60)"], ENV, tmp_path, tmp_path / "w.log")
    time.sleep(0.2)
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(10) == -signal.SIGKILL
