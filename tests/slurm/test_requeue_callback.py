"""SLURMAutoRequeue in one process, without a cluster: what it does with the signal and with ``scontrol``.

The SLURM environment variables make Lightning pick ``SLURMEnvironment`` (auto-requeue on);
a fake ``scontrol`` on ``PATH`` records its arguments. The multi-node behaviour (the save is a
collective at one step boundary, the requeued job resumes) is test_slurm_jobs.py's.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_parallel import SLURMAutoRequeue

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test starts and ends with the handlers pytest had (an error path leaves ours installed)."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


class SignalAt(L.Callback):
    """Sends the requeue signal to this process in the middle of step ``step``'s forward."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def _fit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    scontrol_exit: int,
    signal_step: int = 2,
    accumulate: int = 1,
    **callback_args: float,
) -> L.Trainer:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\nexit {scontrol_exit}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for key, value in dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_PROCID="0",
                           SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_ID="77", SLURM_JOB_NAME="unit",
                           SLURM_NODELIST="127.0.0.1").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=4, default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate, callbacks=[SLURMAutoRequeue(**callback_args), SignalAt(signal_step)],
    )  # fmt: skip
    trainer.fit(BoringModel())
    return trainer


def test_signal_saves_after_the_step_then_requeues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The requeue "succeeds" but nothing ends this process: after exit_timeout_s it fails on its own.
    with pytest.raises(RuntimeError, match="requeued but SLURM did not end it"):
        _fit(tmp_path, monkeypatch, scontrol_exit=0, exit_timeout_s=0.1)
    # (On this error path the Trainer calls no teardown hooks, so the handler stays installed; in
    # a job the process is ending anyway.)
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 77\n"
    checkpoint = tmp_path / "hpc_ckpt_1.ckpt"
    assert checkpoint.is_file()  # the default strategy's one file; ours writes a folder of shards
    # Saved after the step during which the signal arrived (step 3), not inside the handler.
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 3


def test_failed_requeue_warns_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(UserWarning, match="`scontrol requeue` failed"):
        trainer = _fit(tmp_path, monkeypatch, scontrol_exit=1)
    assert trainer.global_step == 4
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)  # handler removed at teardown
    assert (tmp_path / "hpc_ckpt_1.ckpt").is_file()


def test_unfinished_save_is_not_a_resume_point(tmp_path: Path) -> None:
    """Lightning's requeue lookup takes the highest number of any name containing ``hpc_ckpt_`` in
    ``default_root_dir``; the strategy's unfinished (staging) save must not be one of them."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_parallel.checkpoint import atomic

    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    atomic.staging_path(tmp_path / "hpc_ckpt_2.ckpt").mkdir(parents=True)  # a save cut short
    connector = _CheckpointConnector(SimpleNamespace(default_root_dir=str(tmp_path)))
    assert connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")


def test_no_save_between_accumulated_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Signalled in the first of two accumulated batches: the save waits for the optimizer step."""
    with pytest.warns(UserWarning, match="`scontrol requeue` failed"):
        _fit(tmp_path, monkeypatch, scontrol_exit=1, signal_step=0, accumulate=2)
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == 1
