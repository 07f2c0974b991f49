"""Gradient compression and Adafactor on 2 ranks, through the real Trainer; results as JSON.

    python tests/memory/scripts/comm_and_optim.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* set by the launcher

1. ``HybridParallelStrategy()`` on 2 data-parallel ranks (torch's DDP reducer), the recipe GPT:
   ``gradient_compression=None``, ``"bf16"`` and ``PowerSGD(rank=2, start_iter=2)``; the payload
   of every Python all-reduce is counted per optimizer step (the uncompressed reducer runs in
   C++, so its payload is the gradient bytes), and the parameters of both replicas compared.
   Each step's parameters and applied gradient go to ``OUT_DIR/trajectories.pt`` (rank 0), with
   the loss's curvature along each run's departure from the uncompressed one, and a PowerSGD run whose second MLP gradient is doubled
   after the reduction (``powersgd_misapplied``: the negative control of the drift bound).
2. The pipeline path's bucketed all-reduce (``all_reduce_gradients`` with a ``BucketCompressor``),
   called directly on 2 ranks with different random gradients: bf16 and PowerSGD.
   In 1. and 2. every call of torch's compression hooks is recorded (each rank's input bucket and
   what came back: ``tests/memory/powersgd_oracle.py``) into ``OUT_DIR/hook_calls.pt``.
3. ``tensor_parallel=2`` with ``torch.optim.Adafactor`` from ``configure_optimizers``: losses,
   then (rank 0) the same model, data order and optimizer in one process without a Trainer.

Rank 0 writes ``OUT_DIR/result.json``. Run by ``tests/memory/test_comm_and_optim.py``.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_parallel import HybridParallelStrategy, PowerSGD
from lightning_parallel.comm import count_all_reduce_bytes, gradient_bytes
from lightning_parallel.optim import Adafactor, optimizer_state_bytes
from tests.memory.powersgd_oracle import HookRecorder
from tests.models.families import build, make_dataloader, reference_dataloader

STEPS, BATCH = 5, 2
HOOK_CALLS: dict[str, list[dict[str, Any]]] = {}  # this rank's recorded hook calls, by run


@contextmanager
def recorded_hooks(run: str) -> Iterator[None]:
    """Record every call of torch's PowerSGD and cast hooks that lightning_parallel.comm makes."""
    from lightning_parallel.comm import compression

    original_powersgd, original_cast = compression.powerSGD_hook, compression.half_precision_hook
    recorders = [HookRecorder(original_powersgd)]
    compression.powerSGD_hook = recorders[0].as_hook()

    def cast_hook(dtype: torch.dtype) -> Any:
        recorders.append(HookRecorder(original_cast(dtype)))
        return recorders[-1].as_hook()

    compression.half_precision_hook = cast_hook
    try:
        yield
    finally:
        compression.powerSGD_hook, compression.half_precision_hook = original_powersgd, original_cast
        HOOK_CALLS[run] = [call for recorder in recorders for call in recorder.records()]


class StepBytes(L.Callback):
    """Losses and the all-reduce payload of each optimizer step."""

    def __init__(self, log: Any) -> None:
        self.counts, self.bytes, self.losses, self.seen = log, [], [], 0

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.bytes.append(self.counts.bytes - self.seen)
        self.seen = self.counts.bytes


class Trajectory(L.Callback):
    """Each optimizer step's parameters and the gradient it applies (after the all-reduce), flat; the final parameters."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # this rank's

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        self.batches.append(tuple(t.clone() for t in batch))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        self.params.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.params.append(
            torch.cat([p.detach().reshape(-1) for p in module.parameters() if p.requires_grad])
        )


def global_mean(values: list[float]) -> list[float]:
    """Each rank's per-step values averaged over the ranks (a rank's loss is its half batch's)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def curvatures(plain: dict[str, Any], other: dict[str, Any]) -> list[float]:
    """``|H(u_t) D_t| / |D_t|`` per step: the loss's curvature at the uncompressed run's parameters ``u_t``
    along the compressed run's departure ``D_t = x_t - u_t`` (0 where they coincide).

    The smoothness of the drift bound (tests/memory/compression_bound.py): how much the gradient
    changes per unit of that departure. Both ranks take the Hessian-vector product on their own
    half of each batch and average it (the global loss is their mean).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build("recipe_gpt")
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for u, x_t, (x, y) in zip(plain["params"], other["params"], plain["batches"], strict=False):
        departure = (x_t - u).double()
        if float(departure.norm()) == 0.0:
            out.append(0.0)
            continue
        torch.nn.utils.vector_to_parameters(u, params)
        with sdpa_kernel(SDPBackend.MATH):  # the only attention kernel with a second derivative
            logits = model.model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        grads = torch.autograd.grad(loss, params, create_graph=True)
        pieces = torch.split(departure.float(), [p.numel() for p in params])
        hvp = torch.autograd.grad(grads, params, [v.view_as(p) for v, p in zip(pieces, params, strict=True)])
        product = torch.cat([h.reshape(-1) for h in hvp]).double()
        dist.all_reduce(product)
        out.append(float(product.norm() / dist.get_world_size() / departure.norm()))
    return out


class ScaleAfterWarmUp(L.Callback):
    """Test-only: one layer's reduced gradient scaled before the optimizer, from step ``start`` on."""

    def __init__(self, name: str, factor: float, start: int) -> None:
        self.name, self.factor, self.start = name, factor, start

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step >= self.start:
            for name, param in module.named_parameters():
                if self.name in name and param.grad is not None:
                    param.grad.mul_(self.factor)


TRAJECTORIES: dict[str, dict[str, Any]] = {}  # run -> parameters and applied gradients per step, losses


def trainer(strategy: HybridParallelStrategy, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, deterministic=True)  # fmt: skip


def replicas_agree(module: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    return bool(torch.equal(flat, other))


def gradient_compression() -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = (("none", None), ("bf16", "bf16"), ("powersgd", PowerSGD(rank=2, start_iter=2)),
            ("powersgd_misapplied", PowerSGD(rank=2, start_iter=2)))  # fmt: skip
    for name, compression in runs:
        L.seed_everything(0, verbose=False)
        model = build("recipe_gpt")
        with count_all_reduce_bytes() as log, recorded_hooks(f"ddp_{name}"):
            record, trajectory = StepBytes(log), Trajectory()
            callbacks: list[L.Callback] = [record, trajectory]
            if name == "powersgd_misapplied":  # negative control: an error the compressor never saw
                callbacks.insert(0, ScaleAfterWarmUp(".1.mlp.", 2.0, start=2))
            trainer(HybridParallelStrategy(gradient_compression=compression, timeout=60), callbacks).fit(
                model, make_dataloader(BATCH, STEPS * BATCH * 2)
            )
        TRAJECTORIES[f"ddp_{name}"] = {
            "params": trajectory.params,
            "grads": trajectory.grads,
            "losses": global_mean(record.losses),
            "batches": trajectory.batches,  # this rank's
        }
        out[name] = {"bytes": record.bytes, "losses": record.losses, "replicas_agree": replicas_agree(model)}
        out["gradient_bytes"] = gradient_bytes(model.parameters())
        out["gradient_shapes"] = [list(p.shape) for p in model.parameters() if p.requires_grad]
    plain = TRAJECTORIES["ddp_none"]
    for name, trajectory in TRAJECTORIES.items():
        if name != "ddp_none":
            trajectory["curvatures"] = curvatures(plain, trajectory)
    return out


def pipeline_all_reduce() -> dict[str, Any]:
    from lightning_parallel.comm import BucketCompressor
    from lightning_parallel.data_parallel import all_reduce_gradients

    shapes = [(96, 64), (64,), (256, 64), (8, 8)]
    out: dict[str, Any] = {}
    for name, compression in (("bf16", "bf16"), ("powersgd", PowerSGD(rank=2, start_iter=2))):
        compressor, errors, payloads = BucketCompressor(compression), [], []
        with recorded_hooks(f"pipeline_{name}"):
            for step in range(4):
                generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
                params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
                for p in params:
                    p.grad = torch.randn(p.shape, generator=generator)
                exact = [p.grad.clone() for p in params]
                for g in exact:
                    dist.all_reduce(g)
                    g.div_(2)
                with count_all_reduce_bytes() as log:
                    all_reduce_gradients(params, dist.group.WORLD, divisor=2, compressor=compressor)
                payloads.append(log.bytes)
                errors.append(
                    max(float((p.grad - e).norm() / e.norm()) for p, e in zip(params, exact, strict=True))
                )
        out[name] = {"bytes": payloads, "errors": errors, "shapes": [list(s) for s in shapes]}
    return out


def adafactor_tensor_parallel() -> dict[str, Any]:
    from recipes.gpt.module import GPTLightningModule

    class WithAdafactor(GPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return Adafactor(self.parameters(), lr=1e-2)

    tiny = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)

    def fresh() -> WithAdafactor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            return WithAdafactor(**tiny)

    L.seed_everything(0, verbose=False)
    losses = StepBytes(type("NoLog", (), {"bytes": 0})())
    fit = trainer(HybridParallelStrategy(tensor_parallel=2, timeout=60), [losses])
    model = fresh()
    fit.fit(model, make_dataloader(BATCH, STEPS * BATCH))
    state_bytes = optimizer_state_bytes(fit.optimizers[0])
    result: dict[str, Any] = {"losses": losses.losses, "state_bytes_rank0": state_bytes}
    if dist.get_rank() == 0:  # the single-process reference: same model, optimizer and batches
        L.seed_everything(0, verbose=False)
        ref = fresh()
        optimizer = Adafactor(ref.parameters(), lr=1e-2)
        ref_losses = []
        for batch in reference_dataloader(BATCH, 1, STEPS * BATCH, sampler_seed=0):
            loss = torch.nn.functional.cross_entropy(ref.model(batch[0]).view(-1, 128), batch[1].view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ref_losses.append(loss.item())
        result["reference_losses"] = ref_losses
        result["reference_state_bytes"] = optimizer_state_bytes(optimizer)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {
        "gradient_compression": gradient_compression(),
        "pipeline_all_reduce": pipeline_all_reduce(),
        "adafactor_tp2": adafactor_tensor_parallel(),
    }
    calls = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(HOOK_CALLS, calls, dst=0)
    if dist.get_rank() == 0:
        (out_dir / "result.json").write_text(json.dumps(results, indent=1))
        torch.save({run: [rank[run] for rank in calls] for run in HOOK_CALLS}, out_dir / "hook_calls.pt")
        torch.save(TRAJECTORIES, out_dir / "trajectories.pt")
    dist.barrier()
    dist.destroy_process_group()
    print("done")


if __name__ == "__main__":
    main()
