"""Activation bytes and step time of the memory savers on the recipe GPT, measured side by side.

    PYTHONPATH=. python -m benchmarks.memory_savers                  # CPU: the GPT recipe (tiny.yaml shape x4 width)
    PYTHONPATH=. python -m benchmarks.memory_savers --large          # GPU: GPT-1.3B, bf16 autocast (scripts/gpu_check.sh)
    PYTHONPATH=. python -m benchmarks.memory_savers --tiny --cpu     # seconds: every code path

Configurations (the library functions ``HybridParallelStrategy`` applies, on one process, to
one shared model and optimizer: each configuration is applied for its step and removed after):
none, selective (ops), selective (every 2nd block), full, offload, bf16 compression, fp8
compression, full + offload. Each round runs one timed step of every configuration in turn
(interleaved, so drift of a shared machine hits all alike); the step time of a configuration
is its median over the rounds, and its ratio to ``none`` is the median of the per-round ratios.
The first round takes no optimizer step, so every configuration computes its loss on the same
weights and batch: they must be equal (the forward pass is the same under every saver), and so must
their gradients where the saver stores activations exactly (recomputation, offload): each within ten
times the spread of ``none`` run twice, or fp32's rounding where it repeats exactly (``gradients_match``). On a GPU this is what proves the offload's
side-stream copies are ordered right: a copy read early changes a gradient, not the loss.

Columns: activation bytes held for backward on the device (counted exactly through
``saved_tensors_hooks``; offloaded bytes excluded) and their fraction of ``none``; on a GPU
also the peak memory of the step (``torch.cuda.max_memory_allocated`` with the parameters,
gradients and optimizer state subtracted as measured before the step) and its ratio; step
time and its ratio. On a CPU "offload" copies to the same memory: its bytes count as
offloaded, its time is the cost of the copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch

from benchmarks.common import machine, table
from lightning_parallel.memory import (
    ActivationSaver,
    CheckpointingConfig,
    SavedTensorCounter,
    apply_activation_checkpointing,
    counting,
)
from lightning_parallel.plans.detect import find_block_stack

SHAPES = {
    "tiny": dict(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64, batch_size=4),
    "cpu": dict(vocab_size=320, block_size=256, n_layer=4, n_head=4, n_embd=256, batch_size=8),
    "large": dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048, batch_size=8),
}
CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective (ops)": {"checkpointing": CheckpointingConfig("selective", ops=True)},
    "selective (every 2nd block)": {"checkpointing": CheckpointingConfig("selective", every=2)},
    "full": {"checkpointing": CheckpointingConfig("full")},
    "offload": {"offload": True},
    "bf16 compression": {"compression": "bf16"},
    "fp8 compression": {"compression": "fp8"},
    "full + offload": {"checkpointing": CheckpointingConfig("full"), "offload": True},
}


class Setup:
    """One configuration, applied to the shared model for its steps and removed after them.

    All configurations share one model and optimizer (a 1.3B model with AdamW state is ~21 GB:
    one copy per configuration would not fit); a saver changes where activations live, not
    what a step computes, so the step times and bytes of every configuration are comparable.
    """

    def __init__(self, model: torch.nn.Module, options: dict[str, Any], device: torch.device) -> None:
        self.model, self.options, self.device = model, options, device
        stack = find_block_stack(model)
        assert stack is not None
        self.names = [f"{stack.name}.{i}" for i in range(len(stack.blocks))]
        self.saver = None
        if options.get("offload") or options.get("compression"):
            self.saver = ActivationSaver(compression=options.get("compression"), offload=options.get("offload", False),
                                         parameters=list(model.parameters()), blocks=list(stack.blocks))  # fmt: skip
            self.saver.remove()  # block hooks (prefetch groups) are installed only while the saver runs
        self.times: list[float] = []
        self.counted: Any = None
        self.peak = 0
        self.losses: list[float] = []
        self.fingerprint: torch.Tensor | None = None

    def _apply(self) -> list[str]:
        if self.saver is not None:
            self.saver.attach()
        if "checkpointing" not in self.options:
            return []
        return apply_activation_checkpointing(self.model, self.options["checkpointing"], self.names)

    def _remove(self, patched: list[str]) -> None:
        if self.saver is not None:
            self.saver.remove()
        for name in patched:
            del self.model.get_submodule(name).__dict__["forward"]  # the class's forward again

    def step(
        self, optimizer: torch.optim.Optimizer | None, x: torch.Tensor, y: torch.Tensor, count: bool
    ) -> float:
        patched = self._apply()
        try:
            return self._step(optimizer, x, y, count)
        finally:
            self._remove(patched)

    def _step(
        self, optimizer: torch.optim.Optimizer | None, x: torch.Tensor, y: torch.Tensor, count: bool
    ) -> float:
        counter = SavedTensorCounter.for_module(self.model) if count else None
        if self.saver is not None:
            context = self.saver.context(counter)
        else:
            context = counting(counter) if counter is not None else nullcontext()
        autocast = torch.autocast("cuda", torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        with context, autocast:
            logits = self.model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        _sync(self.device)
        elapsed = time.perf_counter() - start
        if optimizer is None:  # the first round: gradients of every configuration on the same weights
            self.fingerprint = gradient_fingerprint(self.model)
            self.model.zero_grad(set_to_none=True)
        else:
            optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - before)
        if counter is not None:
            self.counted = counter.bytes
        self.losses.append(loss.item())
        return elapsed


def gradient_fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Per parameter: the gradient's norm and its projection on a fixed random direction (float64, on the host).

    Two runs' projections differ by about ``|g - g'|`` times a standard normal, so the difference over the
    norm reads the relative error of the whole gradient without keeping a copy of it (GPT-1.3B's gradients
    are 5 GB): a saver that brought back a wrong activation (a copy read before its stream finished) shows.
    """
    rows = []
    for index, param in enumerate(model.parameters()):
        grad = (
            param.grad.detach().float()
            if param.grad is not None
            else torch.zeros_like(param, dtype=torch.float)
        )
        direction = torch.randn(
            grad.shape, generator=torch.Generator(grad.device).manual_seed(index), device=grad.device
        )
        rows.append(torch.stack([grad.norm(), (grad * direction).sum()]))
    return torch.stack(rows).double().cpu()


def gradient_difference(fingerprint: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest relative error of a parameter's gradient against the reference's (see gradient_fingerprint)."""
    trained = reference[:, 0] > 0
    return float(((fingerprint[trained, 1] - reference[trained, 1]).abs() / reference[trained, 0]).max())


FP32_ROUNDING = 1e-6
"""A relative gradient difference this small is rounding, not a wrong activation (used where ``none`` repeats exactly)."""
LOSSLESS = ("selective (ops)", "selective (every 2nd block)", "full", "offload", "full + offload")
"""The savers that must not change a gradient: recomputation reruns the same kernels, offload copies bytes."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(shape: dict[str, Any], device: torch.device, rounds: int, warmup: int) -> dict[str, Any]:
    from recipes.gpt.model import GPT, GPTConfig

    torch.manual_seed(1234)
    with device:
        base = GPT(GPTConfig(**{k: v for k, v in shape.items() if k != "batch_size"}, dropout=0.0))
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(
            shape["vocab_size"], (shape["batch_size"], shape["block_size"] + 1), generator=generator
        )
        for _ in range(rounds + warmup)
    ]
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-5, fused=device.type == "cuda")
    setups = {name: Setup(base, options, device) for name, options in CONFIGS.items()}
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for index, tokens in enumerate(batches):
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        # Round 0 steps no optimizer: every configuration's loss on the same weights and batch.
        step_times = {
            name: s.step(optimizer if index else None, x, y, count=index == 0) for name, s in setups.items()
        }
        if index == 0:
            reference = setups["none"].fingerprint
            assert reference is not None
            differences = {name: gradient_difference(s.fingerprint, reference) for name, s in setups.items()}
            # "none" once more on the same weights and batch: the device's own run-to-run spread (atomics)
            setups["none"].step(None, x, y, count=False)
            noise = gradient_difference(setups["none"].fingerprint, reference)
        if index >= warmup:
            for name, seconds in step_times.items():
                setups[name].times.append(seconds)
                ratios[name].append(seconds / step_times["none"])
    base_bytes = setups["none"].counted.on_device
    rows, results = [], {}
    for name, s in setups.items():
        counted = s.counted
        median = statistics.median(s.times)
        ratio = statistics.median(ratios[name])
        row = [name, f"{counted.on_device / 2**20:.2f} MiB", f"{counted.on_device / base_bytes:.2f}"]
        if device.type == "cuda":
            row += [f"{s.peak / 2**30:.1f} GiB", f"{s.peak / setups['none'].peak:.2f}"]
        row += [f"{median * 1e3:.1f} ms", f"{ratio:.2f}x"]
        rows.append(row)
        results[name] = {"bytes": counted.as_dict(), "step_s": median, "time_ratio": ratio, "peak": s.peak,
                         "first_loss": s.losses[0], "last_loss": s.losses[-1],
                         "gradient_difference": differences[name], "gradient_noise": noise,
                         # equal to none's within ten times the spread of none against itself, or fp32's rounding
                         # where none repeats bit for bit (a wrong activation is orders above either): only the
                         # savers that store every activation exactly
                         "gradients_match": differences[name] <= max(10 * noise, FP32_ROUNDING) if name in LOSSLESS
                         else None}  # fmt: skip
    header = ["configuration", "activations on device", "vs none"]
    if device.type == "cuda":
        header += ["peak step memory", "vs none"]
    header += ["step time", "vs none"]
    print(table(header, rows))
    print(f"round-0 gradients against none's: run-to-run spread of none {noise:.2e}; "
          + ", ".join(f"{name} {d:.2e}" for name, d in differences.items() if name != "none"))  # fmt: skip
    first = {name: r["first_loss"] for name, r in results.items()}
    if len(set(first.values())) != 1:  # the forward pass is the same under every saver
        raise SystemExit(f"configurations do not start from the same loss: {first}")
    return results


def fp8_smoke(steps: int = 5) -> None:
    """A few Trainer steps of the tiny recipe with ``Float8Precision`` against bf16-mixed (GPU with fp8 only)."""
    import lightning as L

    from benchmarks.common import quiet_lightning, recipe_data, recipe_model
    from lightning_parallel import HybridParallelStrategy
    from lightning_parallel.precision.fp8 import Float8Precision, fp8_supported

    supported, reason = fp8_supported()
    if not supported:
        print(f"fp8: not run ({reason})")
        return
    quiet_lightning()
    shape = dict(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64)
    losses = {}
    for name in ("bf16-mixed", "fp8"):
        L.seed_everything(0, verbose=False)
        plugin = {"plugins": [Float8Precision()]} if name == "fp8" else {"precision": "bf16-mixed"}

        class Record(L.Callback):
            def __init__(self) -> None:
                self.seen: list[float] = []

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
                self.seen.append(float(outputs["loss"]))

        record = Record()

        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=HybridParallelStrategy(), max_steps=steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[record], limit_val_batches=0, **plugin)  # fmt: skip
        trainer.fit(recipe_model(**shape), datamodule=recipe_data(64, 8, random_tokens=100_000))
        losses[name] = record.seen
    for name, values in losses.items():
        print(f"{name:10s} losses " + " ".join(f"{v:.4f}" for v in values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="the tiny recipe shape (seconds)")
    size.add_argument("--large", action="store_true", help="GPT-1.3B (a GPU with ~80 GB)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--fp8", action="store_true", help="only: a few steps with Float8Precision vs bf16-mixed"
    )
    args = parser.parse_args(argv)
    if args.fp8:
        fp8_smoke()
        return
    torch.set_num_threads(max(1, torch.get_num_threads() if not args.cpu else 1))
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    name = "tiny" if args.tiny else "large" if args.large else "cpu"
    shape = SHAPES[name]
    rounds = args.rounds or (3 if name == "tiny" else 8)
    print(
        f"# memory_savers: {name} shape {shape}, {rounds} rounds after {args.warmup} warm-up, {device}; {machine()}"
    )
    results = run(shape, device, rounds, args.warmup)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"shape": shape, "device": str(device), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
