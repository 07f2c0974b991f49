"""The strategy's single-device code paths on a real device: each precision through the Trainer, against plain PyTorch.

    PYTHONPATH=. python -m benchmarks.gpu_paths                 # the lent GPU (nccl process group)
    PYTHONPATH=. python -m benchmarks.gpu_paths --cpu --tiny    # the same code paths on the CPU (gloo)

For ``32-true``, ``bf16-mixed`` and ``16-mixed`` (loss scaling), the recipe GPT trains ``--steps``
steps twice from the same weights on the same batches: once through ``Trainer(strategy=
HybridParallelStrategy(process_group_backend=...), devices=1)`` (tensor_parallel=1, dp=1: the
mesh, the precision plugin with its distributed loss scaler, clipping by the global norm), once
by a plain PyTorch loop in the same precision (``torch.autocast``, ``torch.amp.GradScaler``).
Printed and written (``--json``): per precision the largest relative loss difference per step,
whether it is within the precision's tolerance, the steps fp16 skipped, the final loss scale and
the step times. On the CPU, Lightning runs ``16-mixed`` as bf16 (its substitution), so that case
checks bf16 there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.common import machine, quiet_lightning

SHAPES = {
    "tiny": dict(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64, batch_size=4),
    "small": dict(vocab_size=50304, block_size=512, n_layer=6, n_head=8, n_embd=512, batch_size=8),
}
# Largest relative loss difference per step, strategy vs plain loop, in the same precision.
TOLERANCES = {"32-true": 1e-4, "bf16-mixed": 2e-2, "16-mixed": 1e-2}
LR = 1e-3


def _module(shape: dict[str, Any]) -> Any:
    from recipes.gpt.module import GPTLightningModule

    torch.manual_seed(1234)
    module = GPTLightningModule(**{k: v for k, v in shape.items() if k != "batch_size"}, dropout=0.0)
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=LR)  # type: ignore[method-assign]
    return module


def _batches(shape: dict[str, Any], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (steps, shape["batch_size"], shape["block_size"] + 1),
                           generator=generator)  # fmt: skip
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain(shape: dict[str, Any], batches: list, device: torch.device, precision: str) -> dict[str, Any]:
    """The reference: a plain loop in ``precision`` (fp16: dynamic loss scaling with torch's GradScaler)."""
    import torch.nn.functional as F

    module = _module(shape).to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    if device.type == "cpu" and dtype is torch.float16:
        dtype = torch.bfloat16  # as Lightning runs 16-mixed on a CPU
    scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
    losses, times = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = module.model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return {"losses": losses, "step_s": statistics.median(times[1:] or times)}


def strategy(shape: dict[str, Any], batches: list, device: torch.device, precision: str) -> dict[str, Any]:
    """The same through ``Trainer(strategy=HybridParallelStrategy(...))`` on one device."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_parallel import HybridParallelStrategy

    class Record(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            _sync(device)
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            _sync(device)
            self.times.append(time.perf_counter() - self.start)
            self.losses.append(float(outputs["loss"]))

    record = Record()
    backend = "nccl" if device.type == "cuda" else "gloo"
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision=precision, max_steps=len(batches),
        strategy=HybridParallelStrategy(tensor_parallel=1, process_group_backend=backend),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record], limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(_module(shape), train_dataloaders=DataLoader(batches, batch_size=None, shuffle=False))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "losses": record.losses,
        "step_s": statistics.median(record.times[1:] or record.times),
        "loss_scale": float(scaler.get_scale()) if scaler is not None else None,
        "plugin": type(trainer.precision_plugin).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo)")
    parser.add_argument("--tiny", action="store_true", help="the tiny recipe shape")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    quiet_lightning()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    shape = SHAPES["tiny" if args.tiny or device.type == "cpu" else "small"]
    batches = _batches(shape, args.steps)
    print(f"# gpu_paths: {shape}, {args.steps} steps, {device}; {machine()}", flush=True)
    results: dict[str, Any] = {}
    for precision, tolerance in TOLERANCES.items():
        try:
            reference = plain(shape, batches, device, precision)
            ours = strategy(shape, batches, device, precision)
        except Exception as error:  # noqa: BLE001 - a failing precision must not cost the others' numbers
            results[precision] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{precision}: FAILED: {results[precision]['error']}", flush=True)
            continue
        diffs = [
            abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], reference["losses"], strict=True)
        ]
        moved = abs(reference["losses"][-1] - reference["losses"][0]) / abs(reference["losses"][0])
        result = {
            "max_rel_loss_diff": max(diffs), "tolerance": tolerance, "parity": max(diffs) <= tolerance,
            "loss_moved": moved, "strategy_step_s": ours["step_s"], "plain_step_s": reference["step_s"],
            "step_ratio": ours["step_s"] / reference["step_s"], "loss_scale": ours["loss_scale"],
            "plugin": ours["plugin"],
        }  # fmt: skip
        results[precision] = result
        print(f"{precision}: max relative loss difference {max(diffs):.2e} (tolerance {tolerance:g},"
              f" {'ok' if result['parity'] else 'MISSED'}; the loss moved {moved:.1%}), step"
              f" {ours['step_s'] * 1e3:.1f} vs {reference['step_s'] * 1e3:.1f} ms, plugin {ours['plugin']},"
              f" loss scale {ours['loss_scale']}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine(), "device": str(device), "shape": shape, "results": results}, f, indent=1
            )
    failed = [p for p, r in results.items() if "error" in r or not r["parity"]]
    if failed:
        raise SystemExit(f"precisions failed or missed parity: {failed}")


if __name__ == "__main__":
    main()
