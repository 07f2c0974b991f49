"""The strategy under each way a job is started: Lightning's own launcher, torchrun, SLURM.

Each runs the GPT recipe's command line for a few steps with tensor parallelism on two CPU
processes and checks that every process finished and that the mesh was the requested one.
The SLURM case starts the processes as ``srun`` does (one per task, with the ``SLURM_*``
variables that Lightning's ``SLURMEnvironment`` reads); a real ``sbatch`` on a local SLURM
cluster is the multi-node issue's test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.environment import without_launcher
from tests.strategy import ROOT, _free_port

TINY = str(ROOT / "recipes" / "gpt" / "configs" / "tiny.yaml")
SHORT = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
         "--trainer.accelerator=cpu", "--trainer.devices=2"]  # fmt: skip
MESH_LINE = "mesh pp=1 x dp=1 x tp=2 (world 2)"


def _env(**extra: str) -> dict[str, str]:
    env = without_launcher()
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run(command: list[str], cwd: Path, timeout: float = 240, **env: str) -> str:
    done = subprocess.run(command, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_main_job_with_lightning_launcher(tmp_path: Path) -> None:
    """The README's main job: layout from the devices present, checkpoint and metrics written."""
    output = _run([sys.executable, "-m", "recipes.gpt.hybrid", "--trainer.max_steps=4",
                   "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1"], tmp_path)  # fmt: skip
    assert f"{MESH_LINE}, ranks from LightningEnvironment" in output
    run_dir = next((tmp_path / "runs" / "gpt-hybrid").iterdir())
    assert (run_dir / "metrics.csv").read_text().count("val_ppl") == 1
    assert list((run_dir / "checkpoints").iterdir())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "recipes.gpt", "fit", f"--config={TINY}", "--trainer.strategy=tp2_sp", *SHORT]  # fmt: skip
    output = _run(command, tmp_path)
    assert f"{MESH_LINE}, ranks from TorchElasticEnvironment" in output
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in output


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_slurm_tasks(tmp_path: Path) -> None:
    port = str(_free_port())
    common = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
                  SLURM_JOB_NAME="lightning-parallel-test", SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    command = [
        sys.executable,
        "-m",
        "recipes.gpt",
        "fit",
        f"--config={TINY}",
        "--trainer.strategy=tp2",
        *SHORT,
    ]
    ranks = []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        env = _env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), **common)
        ranks.append(
            (subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        )
    outputs = []
    try:
        for process, log in ranks:
            process.wait(timeout=240)
            log.seek(0)
            outputs.append(log.read())
    finally:
        for process, log in ranks:
            if process.poll() is None:
                process.kill()
            log.close()
    for (process, _), output in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, output[-6000:]
    assert f"{MESH_LINE}, ranks from SLURMEnvironment" in outputs[0]
