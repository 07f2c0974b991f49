"""SLURM auto-requeue that saves at a step boundary, so that the requeued job resumes exactly.

Lightning's ``SLURMEnvironment(auto_requeue=True)`` saves ``hpc_ckpt_<n>.ckpt`` under
``default_root_dir`` and runs ``scontrol requeue`` from inside the signal handler; the
requeued job finds the newest ``hpc_ckpt_*`` and resumes from it (``ckpt_path="hpc"``,
chosen automatically under SLURM). The finding and the naming work for our sharded
checkpoints, which are folders. Saving inside the handler does not:

- The handler runs on each rank when *that* rank receives the signal, at whatever Python
  line it is on. A sharded save is a collective, so ranks that are in different places (one
  inside a gradient all-reduce, another still in its forward) issue mismatched collectives:
  a hang, or a corrupt checkpoint.
- Even on one rank, a save between the optimizer step and the loop's bookkeeping records a
  state that no step boundary had, and the resumed run differs from the uninterrupted one.

:class:`SLURMAutoRequeue` keeps Lightning's file names, resume lookup and ``scontrol requeue``,
but the handler only raises a flag. After each optimizer step every rank joins one tiny
all-reduce (max over ranks: one signalled rank is enough); when the flag is up, all ranks save
the hpc checkpoint together, at the same point where ``ModelCheckpoint`` saves, rank 0
requeues the job, and the ranks wait for SLURM to end them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel.compat import cluster_environment, hpc_save_path


def _job_id() -> str:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for array jobs."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def _requeue(job: str) -> int:
    """``scontrol requeue <job>``; its exit status (127: no ``scontrol`` on this node)."""
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return 127
    rank_zero_info(f"SLURMAutoRequeue: scontrol requeue {job}: exit {done.returncode} {done.stderr.strip()}")
    return done.returncode


class SLURMAutoRequeue(Callback):
    """On SLURM's requeue signal: save ``hpc_ckpt_<n>.ckpt`` after the current step, requeue, resume exactly.

    Add it to the Trainer's callbacks (the job files in ``recipes/slurm/`` do, with
    ``--trainer.callbacks+=lightning_parallel.SLURMAutoRequeue``) and ask SLURM for the signal
    before the time limit (``#SBATCH --signal=USR1@120``, ``#SBATCH --requeue``). It acts only
    when the cluster environment is Lightning's ``SLURMEnvironment`` with ``auto_requeue``
    (the default under ``srun``), and listens to its ``requeue_signal`` (``SIGUSR1``). The
    checkpoints go to the Trainer's ``default_root_dir``, which must be on a file system that
    every node sees.

    Args:
        check_every_n_steps: how often the ranks agree on the flag (one all-reduce of one
            number). The save happens at most this many steps after the signal: keep the
            signal's lead time (``@<seconds>``) above that many steps plus one save.
        exit_timeout_s: how long the ranks wait for SLURM to end them after the requeue
            before they fail on their own.
    """

    def __init__(self, check_every_n_steps: int = 1, exit_timeout_s: float = 300.0) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"`check_every_n_steps={check_every_n_steps}` must be at least 1.")
        self.check_every_n_steps = check_every_n_steps
        self.exit_timeout_s = exit_timeout_s
        self._signalled = False
        self._signal: signal.Signals | None = None
        self._previous_handler: Any = None
        self._last_step = -1

    def _on_signal(self, signum: int, _: Any) -> None:
        # Only a flag: see the module docstring for why nothing else may happen here.
        self._signalled = True

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # As Lightning's signal connector reads it: single-device strategies have no attribute for it.
        environment = cluster_environment(trainer)
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return
        if environment.requeue_signal is None or threading.current_thread() is not threading.main_thread():
            return
        # Installed before the Trainer registers its own signal handlers (they come after the
        # setup hooks); Lightning then leaves this signal to us instead of saving in its handler.
        self._signal = environment.requeue_signal
        self._previous_handler = signal.signal(self._signal, self._on_signal)
        rank_zero_info(
            f"{type(self).__name__}: on {self._signal.name} the job saves after the current step,"
            f" requeues (job {_job_id()}) and resumes from {trainer.default_root_dir}/hpc_ckpt_<n>.ckpt"
        )

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._signal is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self._signal, self._previous_handler)
        self._signal = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run starts at the checkpoint's step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Only right after an optimizer step: between accumulated batches the gradients so far are
        # not in a checkpoint. `global_step` is the same on every rank, so all ranks agree on when.
        if self._signal is None or step == self._last_step:
            return
        self._last_step = step
        if step % self.check_every_n_steps:
            return
        if self._any_rank_signalled(trainer):
            self._save_and_requeue(trainer)

    def _any_rank_signalled(self, trainer: L.Trainer) -> bool:
        flag = torch.tensor([1 if self._signalled else 0], device=trainer.strategy.root_device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _save_and_requeue(self, trainer: L.Trainer) -> None:
        path = hpc_save_path(trainer.default_root_dir)  # Lightning's hpc_ckpt_<n+1>.ckpt
        rank_zero_info(
            f"{type(self).__name__}: requeue signal; saving {path} after step {trainer.global_step}"
        )
        for logger in trainer.loggers:
            logger.save()
        # From here SLURM ends the job: the requeue's SIGTERM must end this process, not be
        # turned by the Trainer's handler into more collectives on a job that is going away.
        previous_sigterm = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        trainer.save_checkpoint(path)  # every rank, then a barrier
        status = torch.tensor([0], device=trainer.strategy.root_device)
        if trainer.is_global_zero:
            status[0] = _requeue(_job_id())
        if torch.distributed.is_initialized():
            torch.distributed.broadcast(status, src=0)
        if int(status.item()) != 0:
            signal.signal(signal.SIGTERM, previous_sigterm)
            self._signalled = False
            rank_zero_warn(
                f"{type(self).__name__}: `scontrol requeue` failed (exit {int(status.item())}); the checkpoint"
                f" {path} is saved and training continues. Submit the job with `--requeue` to allow requeueing."
            )
            return
        time.sleep(self.exit_timeout_s)  # SLURM's SIGTERM (then SIGKILL) ends the process during this wait
        raise RuntimeError(
            f"{type(self).__name__}: the job was requeued but SLURM did not end it within {self.exit_timeout_s} s."
        )
