"""The bytes of issue 34's memory terms before and after, on every rank of real Trainer runs (two ranks).

    python tests/strategy/scripts/memory_terms.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Each term at two sizes of what it grows with, switched off (before: what the runtime held until issue 34)
and on (after), the recipe GPT:

- ``casts``: pp2 GPipe, bf16-mixed, 4 blocks, micro-batches of one sequence, M = 2 and 4: the 16-bit weight
  copies (``memory/casts.py``; off: the strategy's ``CastSaver`` switched off);
- ``buffers``: pp2 1F1B, fp32, the same model, M = 2 and 4: the receive buffers (``pipeline/receive_buffers.py``;
  off: torch's one per micro-batch);
- ``loss``: tp2, bf16-mixed, vocabulary 128 and 256: the loss on the vocabulary shards (off: ``loss_parallel=False``);
- ``regather``: tp2 + sp, bf16-mixed, batches of 2 and 4 sequences: the inputs gathered over tp kept as the
  rank's slice (``memory/regather.py``; off: kept whole).

Recorded per run, of the second step: the saved-tensor counter's peak and total (``ActivationMemoryMonitor``),
the most bytes the receive buffers held at once (torch's: held all run), and the peak of every storage made during the step and alive at
once (:class:`LiveBytes`, a dispatch mode standing in for a CPU allocator's statistics). Writes
``OUT_DIR/memory_terms.rank{r}.json``.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_parallel import ActivationMemoryMonitor, HybridParallelStrategy
from lightning_parallel.memory.counting import local_tensor
from lightning_parallel.pipeline.receive_buffers import receive_buffer_bytes
from tests.models.families import SEQ_LEN, build, make_dataloader

STEPS = 2
PIPE = {"n_layer": 4}
# name: (family overrides, strategy arguments, precision, batch per rank, what is switched off)
RUNS: dict[str, tuple[dict, dict, str, int, str | None]] = {}
for _m in (2, 4):
    for _on in (False, True):
        _tag = "after" if _on else "before"
        RUNS[f"casts_M{_m}_{_tag}"] = (PIPE, {"pipeline_parallel": 2, "micro_batches": _m, "pipeline_schedule": "gpipe"},
                                       "bf16-mixed", _m, None if _on else "casts")  # fmt: skip
        RUNS[f"buffers_M{_m}_{_tag}"] = (PIPE, {"pipeline_parallel": 2, "micro_batches": _m}, "32-true", _m,
                                         None if _on else "buffers")  # fmt: skip
for _m in (4, 8):  # two stages a rank: torch's runtime keeps every send until the step ends
    for _on in (False, True):
        _tag = "after" if _on else "before"
        RUNS[f"sends_M{_m}_{_tag}"] = (PIPE, {"pipeline_parallel": 2, "micro_batches": _m,
                                              "pipeline_schedule": "interleaved_1f1b"}, "32-true", _m,
                                       None if _on else "sends")  # fmt: skip
for _b in (2, 4):
    for _on in (False, True):
        _tag = "after" if _on else "before"
        RUNS[f"regather_B{_b}_{_tag}"] = ({}, {"tensor_parallel": 2, "sequence_parallel": True}, "bf16-mixed", _b,
                                          None if _on else "regather")  # fmt: skip
for _v in (128, 256):
    for _on in (False, True):
        _tag = "after" if _on else "before"
        RUNS[f"loss_V{_v}_{_tag}"] = ({"vocab_size": _v}, {"tensor_parallel": 2, **({} if _on else {"loss_parallel": False})},
                                      "bf16-mixed", 4, None)  # fmt: skip


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made while active and still alive, and their peak: what an allocator counts."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak = [0], 0
        self._storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_pointer(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):  # a view or an in-place result is no allocation
            if isinstance(tensor, torch.Tensor) and _pointer(tensor) not in inputs:
                self._note(local_tensor(tensor).untyped_storage())
        return out

    def _note(self, storage: torch.UntypedStorage) -> None:
        known = self._storages.get(storage.data_ptr())
        if known is not None and known() is storage or not storage.nbytes():
            return
        self._storages[storage.data_ptr()] = weakref.ref(storage)
        self.live[0] += storage.nbytes()
        self.peak = max(self.peak, self.live[0])
        weakref.finalize(storage, _release, self.live, storage.nbytes())


def _pointer(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage().data_ptr()


def _release(live: list[int], nbytes: int) -> None:
    live[0] -= nbytes


class Recorder(L.Callback):
    """Switches the term off (before), watches the last step with :class:`LiveBytes`, reads the buffers."""

    def __init__(self, switch_off: str | None) -> None:
        self.switch_off, self.allocator_peak, self.buffers, self.sends_released = switch_off, 0, 0, 0
        self.mode: LiveBytes | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.switch_off == "casts":
            trainer.strategy.casts.weights = trainer.strategy.casts.activations = False
        if self.switch_off == "buffers":
            for stage in trainer.strategy.pipeline_stages:
                stage.receive_buffers.enabled = False
        if self.switch_off == "regather":
            trainer.strategy.regather.enabled = False
        if self.switch_off == "sends":
            trainer.strategy.pipeline_runner.sends.enabled = False

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == STEPS - 1:
            self.mode = LiveBytes()
            self.mode.__enter__()

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.allocator_peak, self.mode = self.mode.peak, None
            runner = trainer.strategy.pipeline_runner
            self.sends_released = runner.sends.released if runner is not None else 0
            self.buffers = sum(s.receive_buffers.peak_bytes if s.receive_buffers.enabled else receive_buffer_bytes(s)
                               for s in trainer.strategy.pipeline_stages)  # fmt: skip


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = {}
    only = sys.argv[2:]
    for name, (overrides, strategy, precision, batch, switch_off) in RUNS.items():
        if only and name not in only:
            continue
        L.seed_everything(0, verbose=False)
        monitor, recorder = ActivationMemoryMonitor(), Recorder(switch_off)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=STEPS, logger=False, callbacks=[monitor, recorder],
            strategy=HybridParallelStrategy(timeout=60, **strategy), precision=precision, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(build("recipe_gpt", **overrides), make_dataloader(batch, batch * 2 * STEPS))
        results[name] = {
            "peak": monitor.steps[-1].peak, "total": monitor.steps[-1].total, "buffers": recorder.buffers,
            "allocator_peak": recorder.allocator_peak, "batch": batch, "sequence": SEQ_LEN,
            "sends_released": recorder.sends_released,
        }  # fmt: skip
    (out_dir / f"memory_terms.rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
