"""The GPT job file on a real local SLURM cluster: 2 nodes x 2 tasks, and a requeue with exact resume.

``scripts/slurm_cluster.sh up`` starts the cluster (two emulated nodes, node1 and node2) for
this module and ``down`` stops it. Two identical jobs of ``recipes/slurm/gpt.sbatch`` run side by
side (tiny GPT, CPU, gloo; tensor_parallel=2 inside each node, data parallel 2 across nodes):

- the uninterrupted job runs to completion;
- the second job gets ``scancel --signal=USR1`` after step ``SIGNAL_AFTER`` (what
  ``#SBATCH --signal=USR1@<s>`` sends before the time limit: every task, not the batch shell,
  which would die of it). It must save ``hpc_ckpt_1.ckpt``, requeue itself, start again from
  that checkpoint and end with the uninterrupted job's final loss (fp32, relative 1e-5).

The signal lands wherever each rank happens to be in a later step (the job is paced at
``PACE_S`` per step before the signal so that it is still running); SLURMAutoRequeue must turn
that into one save at one step boundary on every rank.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm import ROOT, Cluster, Job, cluster

# 900 s: the first test also starts the cluster (apt install on a clean machine); every wait below is bounded.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

MAX_STEPS = 20
SIGNAL_AFTER = 6  # mid-epoch: an epoch of the tiny config on 2 data-parallel replicas is ~300 steps
PACE_S = 0.5
RTOL = 1e-5
SBATCH = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]
RECIPE = [
    "--trainer.accelerator=cpu",
    f"--trainer.max_steps={MAX_STEPS}",
    f"--trainer.val_check_interval={MAX_STEPS}",
    "--trainer.limit_val_batches=1",
    "--trainer.callbacks+=tests.slurm.probe.StepProbe",
]
ENV = dict(CONFIG=str(ROOT / "recipes" / "gpt" / "configs" / "tiny.yaml"), TP="2", OMP_NUM_THREADS="1")
MESH_LINE = "mesh pp=1 x dp=2 x tp=2 (world 4), ranks from SLURMEnvironment"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = time.monotonic()
    cluster("up", timeout_s=600)
    print(f"cluster up in {time.monotonic() - started:.1f} s")
    jobs = Cluster(tmp_path_factory.mktemp("slurm_jobs"))
    try:
        yield jobs
    finally:
        jobs.cancel_all()
        cluster("down", timeout_s=60)


@pytest.fixture(scope="module")
def two_jobs(slurm: Cluster) -> tuple[Job, Job]:
    """Both jobs run side by side (16 advertised CPUs, 4 used each); the second is signalled mid-run."""
    straight = slurm.sbatch("gpt.sbatch", SBATCH, RECIPE, **ENV)
    requeued = slurm.sbatch("gpt.sbatch", SBATCH, [*RECIPE, f"--trainer.callbacks.pace_s={PACE_S}"], **ENV)
    slurm.wait_for_line(requeued, rf"^PROBE step={SIGNAL_AFTER} ", timeout_s=300)
    # Every task of every step, as `#SBATCH --signal=USR1@<s>` does (not --batch/--full: the
    # batch shell has no handler and would end the job).
    slurm.run("scancel", "--signal=USR1", requeued.job_id)
    return straight, requeued


def _times(info: dict[str, str]) -> str:
    return f"submitted {info['SubmitTime']}, (re)started {info['StartTime']}, ended {info['EndTime']}"


def _cpu(text: str) -> str:
    """CPU seconds of rank 0 in each run of the job (see StepProbe)."""
    return ", ".join(
        f"run {r}: {c} s" for c, r in re.findall(r"^PROBE cpu_s=(\S+) restart=(\d+)$", text, re.M)
    )


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^PROBE step=(\d+) loss=(\S+) restart=\d+$", text, re.M)}


def test_gpt_job_two_nodes_runs_to_completion(slurm: Cluster, two_jobs: tuple[Job, Job]) -> None:
    job, _ = two_jobs
    started = time.monotonic()
    info = slurm.wait(job, timeout_s=400)
    text = job.text()
    waited = time.monotonic() - started
    print(
        f"uninterrupted job {job.job_id}: {waited:.1f} s after the fixture, {_times(info)}; CPU {_cpu(text)}"
    )
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-6000:]}"
    assert info["NodeList"] == "node[1-2]" and info["NumNodes"] == "2", info
    assert MESH_LINE in text, text[-6000:]
    assert "tensor-parallel groups span nodes" not in text  # ranks 0,1 on node1 and 2,3 on node2
    assert sorted(_losses(text)) == list(range(1, MAX_STEPS + 1)), text[-6000:]
    assert f"`Trainer.fit` stopped: `max_steps={MAX_STEPS}` reached." in text


def test_signalled_job_requeues_and_resumes_with_the_same_loss(
    slurm: Cluster, two_jobs: tuple[Job, Job]
) -> None:
    straight, job = two_jobs
    started = time.monotonic()
    info = slurm.wait(job, timeout_s=400)
    text = job.text()
    waited = time.monotonic() - started
    print(f"signalled job {job.job_id}: {waited:.1f} s after the fixture, {_times(info)}; CPU {_cpu(text)}")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{text[-6000:]}"
    assert info["Restarts"] == "1", f"the job was not requeued: {info}\n{text[-6000:]}"

    saved = re.search(r"saving (\S+) after step (\d+)", text)
    resumed = re.search(r"^PROBE start step=(\d+) restart=1$", text, re.M)
    assert saved and resumed, text[-6000:]
    assert Path(saved[1]).name == "hpc_ckpt_1.ckpt" and (Path(slurm.workdir) / saved[1]).is_dir(), saved[1]
    step = int(saved[2])
    assert SIGNAL_AFTER <= step < MAX_STEPS and int(resumed[1]) == step, (step, resumed[0])
    assert f"Restoring states from the checkpoint path at {saved[1]}" in text  # Lightning's ckpt_path="hpc"

    slurm.wait(straight, timeout_s=400)
    reference = _losses(straight.text())
    losses = _losses(text)
    # The step after which it saved is not printed: SLURMAutoRequeue's hook runs before the probe's
    # and the process ends there; the resumed run starts after it.
    expected = [s for s in range(1, MAX_STEPS + 1) if s != step]
    assert sorted(losses) == expected, f"steps logged across both runs: {sorted(losses)}"
    trajectory = "\n".join(f"step {s}: {losses[s]!r} vs {reference[s]!r}" for s in sorted(losses))
    for s in range(1, step):  # before the signal the jobs are the same computation
        assert losses[s] == pytest.approx(reference[s], rel=RTOL), trajectory
    assert losses[MAX_STEPS] == pytest.approx(reference[MAX_STEPS], rel=RTOL), (
        f"resumed after step {step}; final loss differs from the uninterrupted job:\n{trajectory}"
    )
