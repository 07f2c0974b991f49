"""Save mid-epoch and resume a sharded checkpoint in the same layout (tp=2 on 2 ranks), recording losses.

    python tests/strategy/scripts/checkpoint_resume.py first  OUT_DIR [LAYOUTS]  # 6 steps straight; 3 steps + save
    python tests/strategy/scripts/checkpoint_resume.py resume OUT_DIR [LAYOUTS]  # fresh processes: resume to step 6

``LAYOUTS``: comma-separated, each run in turn by the same processes, into ``OUT_DIR/<layout>/``.

``LAYOUT`` is ``tp2`` (default), ``pp2`` (two pipeline stages, 2 micro-batches, 1F1B; the
sharded checkpoint only: each stage writes its own blocks) or ``ep2`` (the MoE recipe with its
4 experts sharded over 2 ranks; sharded checkpoint only).

Two checkpoints of the same state are written after step 3: ``step3.ckpt``, sharded (a folder of
``torch.distributed.checkpoint`` files, the strategy's default), and ``step3.full.ckpt``, one
consolidated file (``save_distributed_checkpoint=False``); the resume run loads each in turn.

Run by ``tests/strategy/test_checkpoint_resume.py`` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set.
Writes ``OUT_DIR/<run>.rank<r>.json``: the per-step training losses of that rank, and (rank 0,
``straight`` run) the plan's parameter sizes after sharding, for the CLI's arithmetic.
An epoch has 4 batches and the first half stops after step 3 (``max_steps=3``); the checkpoint is
taken mid-epoch by ``ModelCheckpoint(every_n_train_steps=3)``, and again by
``trainer.save_checkpoint`` after ``fit`` returned (``after_fit.ckpt``: Lightning counts the epoch
that ``max_steps`` cut short as finished; the strategy reopens it, ``checkpoint/loop_state.py``).
A third run raises before step 4 and Lightning's ``OnExceptionCheckpoint`` saves
(``on_exception.ckpt``). Each resumed run must continue with batch 4 of epoch 0, then epoch 1 in
its own order. The loaders are plain, shuffled DataLoaders: ``RandomSampler`` drawing from the
global random state (tp2, pp2: ``use_distributed_sampler=False``, every rank the same order) or
Lightning's ``DistributedSampler`` (ep2: two data-parallel ranks). The model has dropout, so
the random states must be restored too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

MODEL = dict(
    vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, learning_rate=3e-3, warmup_steps=2,
    lr_decay_steps=6, weight_decay=0.1,
)  # fmt: skip
BATCH_SIZE, BATCHES_PER_EPOCH, STEPS, FIRST_HALF = 4, 4, 6, 3
DROPOUT = 0.1


class RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[list[int]] = []  # (epoch, batch index, first token of each sample): the data order
        self.scales: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.batches.append([trainer.current_epoch, i, *batch[0][:, 0].tolist()])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # fp16: the loss scale after this step's update (it grows every 2 steps)
            self.scales.append(float(scaler.get_scale()))


class CrashAt(L.Callback):
    """Raises on every rank when step ``step + 1`` is about to start (its batch fetched, nothing trained)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash before step {self.step + 1}")


class SignalAt(L.Callback):
    """Sends ``signum`` to this process on rank ``rank`` only, at the end of step ``step`` (the other ranks must
    learn of it from the strategy, or from SLURMAutoRequeue's agreement, and stop or save with it)."""

    def __init__(self, signum: int, step: int, rank: int) -> None:
        self.signum, self.step, self.rank = signum, step, rank

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


def fake_slurm(out: Path, rank: int) -> dict[str, str]:
    """The variables under which Lightning runs as a SLURM job (auto-requeue on), and a ``scontrol`` on PATH
    whose requeue fails: SLURMAutoRequeue then saves and training goes on (the requeue itself: tests/slurm)."""
    bin_dir = out / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\nexit 1\n")
    scontrol.chmod(0o755)
    return dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="77", SLURM_JOB_NAME="resume",
                SLURM_NODELIST="127.0.0.1", PATH=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip


class SaveConsolidated(L.Callback):
    """The same state as ModelCheckpoint's sharded folder, as one file (``save_distributed_checkpoint=False``)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.step:
            trainer.strategy._save_distributed_checkpoint = False
            trainer.save_checkpoint(self.path)
            trainer.strategy._save_distributed_checkpoint = True


class Stream(IterableDataset):
    """Samples in an order drawn from the global random state when each epoch's iteration starts."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __iter__(self) -> Any:
        for i in torch.randperm(len(self.tokens)).tolist():
            yield self.tokens[i, :-1], self.tokens[i, 1:]


def loader(
    data_parallel: int = 1, user_sampler: bool = False, stateful: bool = False, kind: str = ""
) -> DataLoader:
    """``BATCHES_PER_EPOCH`` shuffled batches per rank and epoch (``data_parallel`` ranks share the samples).

    ``user_sampler``: the user's own ``DistributedSampler`` (one replica: the tensor-parallel ranks
    read the same batches), its order a function of its seed and epoch. ``stateful``: torchdata's
    ``StatefulDataLoader``, whose own state Lightning saves.
    """
    from torch.utils.data import DistributedSampler

    tokens = torch.randint(MODEL["vocab_size"], (BATCH_SIZE * BATCHES_PER_EPOCH * data_parallel, MODEL["block_size"] + 1),
                           generator=torch.Generator().manual_seed(7))  # fmt: skip
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    if kind == "iterable":
        return DataLoader(Stream(tokens), batch_size=BATCH_SIZE)
    if user_sampler:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
        return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)


LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": dict(tensor_parallel=2),
    "pp2": dict(pipeline_parallel=2, micro_batches=2, pipeline_schedule="1f1b"),
    "ep2": dict(expert_parallel=2),
    "tp2_fp16": dict(tensor_parallel=2),  # with "16-mixed" and a loss scaler that changes every 2 steps
    "tp2_sampler": dict(tensor_parallel=2),  # the user's own DistributedSampler in a plain DataLoader
    "dp2": dict(),  # two data-parallel ranks, Lightning's DistributedSampler
    # torchdata's StatefulDataLoader instead of a plain DataLoader
    "tp2_stateful": dict(tensor_parallel=2),
    "pp2_stateful": dict(pipeline_parallel=2, micro_batches=2, pipeline_schedule="1f1b"),
    "dp2_stateful": dict(),
    # an IterableDataset
    "tp2_iterable": dict(tensor_parallel=2),
    "pp2_iterable": dict(pipeline_parallel=2, micro_batches=2, pipeline_schedule="1f1b"),
}
DATA_PARALLEL = ("ep2", "dp2", "dp2_stateful")


def precision(layout: str) -> dict[str, Any]:
    if layout != "tp2_fp16":
        return {"precision": "32-true"}
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


def build_model(layout: str) -> L.LightningModule:
    if layout == "ep2":
        from recipes.moe.module import MoEGPTLightningModule

        return MoEGPTLightningModule(**MODEL, num_experts=4, top_k=2, capacity_factor=1.25, dropout=DROPOUT)
    return GPTLightningModule(**MODEL, dropout=DROPOUT)


def fit(
    out: Path,
    run: str,
    max_steps: int,
    ckpt_path: Path | None = None,
    save_to: Path | None = None,
    layout: str = "tp2",
    crash_into: Path | None = None,
    interrupt_into: Path | None = None,
    signal_slurm: bool = False,
) -> None:
    L.seed_everything(0)
    model = build_model(layout)
    recorder = RecordLosses()
    callbacks: list[L.Callback] = [recorder]
    if (
        interrupt_into is not None
    ):  # Ctrl+C on rank 1 only after step 2: every rank stops before step 4, saves
        from lightning.pytorch.callbacks import OnExceptionCheckpoint

        callbacks += [
            SignalAt(signal.SIGINT, 2, rank=1),
            OnExceptionCheckpoint(dirpath=interrupt_into.parent, filename=interrupt_into.stem),
        ]
    environment = {}
    if signal_slurm:  # SLURM's requeue signal on rank 0 after step 2: every rank saves after step 3, goes on
        from lightning_parallel import SLURMAutoRequeue

        callbacks += [SLURMAutoRequeue(), SignalAt(signal.SIGUSR1, 2, rank=0)]
        environment = fake_slurm(out, int(os.environ["RANK"]))
    if crash_into is not None:  # an exception before step 4; Lightning's OnExceptionCheckpoint saves
        from lightning.pytorch.callbacks import OnExceptionCheckpoint

        callbacks += [
            CrashAt(FIRST_HALF),
            OnExceptionCheckpoint(dirpath=crash_into.parent, filename=crash_into.stem),
        ]
    if save_to is not None:  # saved during step 3's on_train_batch_end, as ModelCheckpoint saves
        if layout == "tp2":
            callbacks.append(SaveConsolidated(save_to.with_suffix(".full.ckpt"), FIRST_HALF))
        callbacks.append(
            ModelCheckpoint(dirpath=save_to.parent, filename=save_to.stem, every_n_train_steps=FIRST_HALF)
        )
    data_parallel = 2 if layout in DATA_PARALLEL else 1  # experts are carved out of two data-parallel ranks
    saved_environment = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(timeout=60, **LAYOUTS[layout]),
        **precision(layout), max_steps=max_steps, use_distributed_sampler=data_parallel > 1, callbacks=callbacks,
        logger=False, enable_checkpointing=save_to is not None or crash_into is not None or interrupt_into is not None,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out,
    )  # fmt: skip
    kind = layout.rpartition("_")[2]
    data = loader(data_parallel, user_sampler=kind == "sampler", stateful=kind == "stateful", kind=kind)
    try:
        trainer.fit(model, data, ckpt_path=ckpt_path)
    except RuntimeError as error:
        if crash_into is None or "injected crash" not in str(error):
            raise
    except SystemExit:  # Lightning ends the process after a KeyboardInterrupt (and its checkpoint)
        if interrupt_into is None:
            raise
    if save_to is not None:  # the other save path: after fit returned (max_steps cut the epoch short)
        trainer.save_checkpoint(save_to.with_name("after_fit.ckpt"))
    result: dict[str, Any] = {
        "losses": recorder.losses, "batches": recorder.batches, "scales": recorder.scales,
        "global_step": trainer.global_step,
    }  # fmt: skip
    if trainer.global_rank == 0 and layout == "tp2":
        plan = trainer.strategy.plan
        result["parameter_shards"] = {name: list(sizes) for name, sizes in plan.parameter_shards.items()}
    (out / f"{run}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
    for key, value in saved_environment.items():  # after the last read of the SLURM environment's rank
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def main(mode: str, out: Path, layouts: str = "tp2") -> None:
    torch.set_num_threads(1)
    for layout in layouts.split(","):  # one launch runs every layout: start-up dominates
        run_layout(mode, out / layout, layout)


def run_layout(mode: str, out: Path, layout: str) -> None:
    out.mkdir(exist_ok=True)
    checkpoint = out / "step3.ckpt"
    if mode == "first":
        fit(out, "straight", STEPS, layout=layout)
        fit(out, "first_half", FIRST_HALF, save_to=checkpoint, layout=layout)
        if not layout.endswith("_iterable"):  # see STOPPED_AT_A_BATCH in the test
            fit(out, "crashed", STEPS, layout=layout, crash_into=out / "on_exception.ckpt")
            fit(out, "interrupted", STEPS, layout=layout, interrupt_into=out / "on_interrupt.ckpt")
        fit(out, "signalled", STEPS, layout=layout, signal_slurm=True)
    elif mode == "resume":
        fit(out, "resumed", STEPS, ckpt_path=checkpoint, layout=layout)
        fit(out, "resumed_after_fit", STEPS, ckpt_path=out / "after_fit.ckpt", layout=layout)
        if not layout.endswith("_iterable"):
            fit(out, "resumed_after_crash", STEPS, ckpt_path=out / "on_exception.ckpt", layout=layout)
            fit(out, "resumed_after_interrupt", STEPS, ckpt_path=out / "on_interrupt.ckpt", layout=layout)
        fit(out, "resumed_after_signal", STEPS, ckpt_path=out / "hpc_ckpt_1.ckpt", layout=layout)
        if layout == "tp2":
            fit(out, "resumed_full", STEPS, ckpt_path=checkpoint.with_suffix(".full.ckpt"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
