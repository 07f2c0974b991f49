"""SLURM tests: real ``sbatch`` jobs on the local cluster that ``scripts/slurm_cluster.sh`` starts.

:class:`Cluster` submits the project's job files (``recipes/slurm/*.sbatch``) with the
overrides a CPU run needs, reads job state from ``scontrol show job`` (the local cluster has no
accounting database for ``sacct``) and the job's output file, and cancels every job it
submitted when the tests end, so that no job outlives a failed or timed-out test.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.environment import without_launcher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
# The script's default root: `up` there also stops what an interrupted test run left running.
CLUSTER_ROOT = "/tmp/lightning-parallel-slurm"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}  # fmt: skip


def cluster_env() -> dict[str, str]:
    """This process's environment without any scheduler's or launcher's variables, pointed at the cluster."""
    env = without_launcher(prefixes=("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "PL_"))
    env.update(SLURM_CONF=f"{CLUSTER_ROOT}/etc/slurm.conf", SLURM_CI_ROOT=CLUSTER_ROOT)
    return env


def cluster(command: str, timeout_s: float) -> str:
    """``scripts/slurm_cluster.sh up|down``; its output, or an error with it."""
    done = subprocess.run(["bash", str(SCRIPT), command], env=cluster_env(), capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    assert done.returncode == 0, (
        f"slurm_cluster.sh {command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@dataclass
class Job:
    job_id: str
    output: Path

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


@dataclass
class Cluster:
    """Submits jobs to the running local cluster and keeps their ids, to cancel them at the end."""

    workdir: Path
    jobs: list[Job] = field(default_factory=list)

    def run(self, *args: str, timeout_s: float = 30) -> str:
        done = subprocess.run(
            list(args), env=cluster_env(), capture_output=True, text=True, timeout=timeout_s
        )
        assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def sbatch(self, job_file: str, sbatch_args: list[str], recipe_args: list[str], **env: str) -> Job:
        """Submit ``recipes/slurm/<job_file>`` from ``workdir`` with the repository's Python and code."""
        name = Path(job_file).stem
        env_args = ",".join(f"{k}={v}" for k, v in env.items())
        out = self.run(
            "sbatch", "--parsable", f"--chdir={self.workdir}", f"--output={self.workdir}/{name}-%j.out",
            f"--export=ALL,PYTHON={sys.executable},PYTHONPATH={ROOT},PYTHONUNBUFFERED=1,{env_args}",
            *sbatch_args, str(ROOT / "recipes" / "slurm" / job_file), *recipe_args,
        )  # fmt: skip
        job_id = out.strip().split(";")[0]
        job = Job(job_id, self.workdir / f"{name}-{job_id}.out")
        self.jobs.append(job)
        return job

    def info(self, job: Job) -> dict[str, str]:
        """``scontrol show job -o``: ``JobState``, ``Restarts``, ``ExitCode``, ..."""
        line = self.run("scontrol", "show", "job", "-o", job.job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait(self, job: Job, timeout_s: float) -> dict[str, str]:
        """Wait for a final state; past ``timeout_s`` the job is cancelled and the test fails."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.info(job)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(1)
        self.cancel(job)
        raise AssertionError(f"job {job.job_id} did not end within {timeout_s} s:\n{job.text()[-6000:]}")

    def wait_for_line(self, job: Job, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait until the job's output has a line matching ``pattern`` (cancel and fail otherwise)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, job.text(), re.MULTILINE)
            if found:
                return found
            if self.info(job).get("JobState") in FINAL_STATES:
                break
            time.sleep(0.2)
        self.cancel(job)
        raise AssertionError(
            f"job {job.job_id}: no line {pattern!r} within {timeout_s} s:\n{job.text()[-6000:]}"
        )

    def cancel(self, job: Job) -> None:
        subprocess.run(["scancel", job.job_id], env=cluster_env(), capture_output=True, timeout=30)

    def cancel_all(self) -> None:
        for job in self.jobs:
            self.cancel(job)
