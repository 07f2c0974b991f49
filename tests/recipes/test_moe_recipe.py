"""Single-process tests of the MoE recipe: model, module, callbacks, configs, CLI. CPU, no network."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.experts import MoE, moe_layers
from recipes.gpt.model import MLP
from recipes.moe import ExpertLoad, MoEGPT, MoEGPTConfig, MoEGPTLightningModule
from recipes.moe.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "recipes" / "moe" / "configs"
TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, num_experts=4, top_k=2)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_model_shapes_moe_every_and_active_parameters() -> None:
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(**{**TINY, "n_layer": 3, "moe_every": 2}))
    assert [type(b.mlp) for b in model.transformer.h] == [MoE, MLP, MoE]  # the last block is MoE
    assert model(torch.randint(64, (2, 16))).shape == (2, 16, 64)
    per_expert = 2 * 32 * 128 + 128 + 32  # w_in, w_out, b_in, b_out of one expert
    assert model.num_params() - model.num_params(active=True) == 2 * per_expert * (4 - 2)
    with pytest.raises(ValueError, match="moe_every=0"):
        MoEGPTConfig(**{**TINY, "moe_every": 0})
    with pytest.raises(ValueError, match="top_k=5"):
        MoEGPT(MoEGPTConfig(**{**TINY, "top_k": 5}))


def test_large_config_has_8_experts_and_about_1b_parameters() -> None:
    shape = yaml.safe_load((CONFIGS / "large-8e-1b.yaml").read_text())["model"]
    keys = set(MoEGPTConfig.__dataclass_fields__)
    with torch.device("meta"):
        model = MoEGPT(MoEGPTConfig(**{k: v for k, v in shape.items() if k in keys}))
    assert shape["num_experts"] == 8
    assert 0.95e9 < model.num_params() < 1.05e9
    assert 0.25e9 < model.num_params(active=True) < 0.35e9


class _HistogramLogger(Logger):
    """A logger whose experiment has TensorBoard's ``add_histogram_raw`` (tensorboard is not installed)."""

    def __init__(self) -> None:
        super().__init__()
        self.histograms: list[dict[str, Any]] = []
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "histograms"

    @property
    def version(self) -> int:
        return 0

    @property
    def experiment(self) -> _HistogramLogger:
        return self

    def add_histogram_raw(self, tag: str, **kwargs: Any) -> None:
        self.histograms.append({"tag": tag, **kwargs})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _pattern_loader(steps: int, batch: int = 8, seq: int = 16) -> DataLoader:
    """A repeating token pattern: learnable in a few steps."""
    stream = torch.arange(batch * steps * (seq + 1)) % 7
    windows = stream.view(-1, seq + 1)
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=batch)


def test_a_few_steps_train_and_log_expert_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = MoEGPTLightningModule(
        **TINY, capacity_factor=1.0, learning_rate=1e-2, warmup_steps=1, lr_decay_steps=100
    )
    histograms = _HistogramLogger()
    csv_logger = L.pytorch.loggers.CSVLogger(tmp_path, name="moe")
    trainer = L.Trainer(accelerator="cpu", max_steps=8, log_every_n_steps=4, logger=[histograms, csv_logger],
                        callbacks=[ExpertLoad()], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(module, _pattern_loader(8))
    assert trainer.global_step == 8
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
    assert 0.0 <= float(trainer.callback_metrics["moe/dropped_fraction"]) < 1.0
    assert float(trainer.callback_metrics["train_aux_loss"]) > 0
    # one histogram per MoE layer at steps 4 and 8, one bucket per expert, every assignment counted
    tags = [h["tag"] for h in histograms.histograms]
    assert tags == ["moe/layer0/expert_load", "moe/layer1/expert_load"] * 2
    last = histograms.histograms[-1]
    assert len(last["bucket_counts"]) == 4 and last["num"] == 8 * 16 * 2
    assert any("moe/layer1/max_load" in m for m in histograms.metrics)
    # CSV has no histograms: one share per expert instead
    csv_logger.finalize("success")
    with open(Path(csv_logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    shares = [float(rows_i[f"moe/layer0/expert{e}"]) for rows_i in rows if rows_i.get("moe/layer0/expert0")
              for e in range(4)]  # fmt: skip
    assert shares and sum(shares[:4]) == pytest.approx(1.0)
    assert all(moe.aux_loss > 0 for moe in moe_layers(module))


def test_cli_fit_tiny_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = [
        "fit",
        "--config", str(CONFIGS / "tiny.yaml"),
        "--trainer.max_steps", "2",
        "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--model.block_size", "32",
        "--data.batch_size", "4",
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["recipes.moe"])
    cli = main(args)
    assert cli.trainer.global_step == 2
    assert cli.datamodule.block_size == 32
    run_dir = tmp_path / "moe-tiny" / "version_0"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(row["train_loss"] for row in rows) and any(row["moe/dropped_fraction"] for row in rows)
    assert any(row.get("moe/layer1/expert3") for row in rows)


def test_weight_decay_skips_biases_and_norms() -> None:
    module = MoEGPTLightningModule(**TINY, lr_decay_steps=10)
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    layer = module.model.transformer.h[0].mlp
    assert any(p is layer.experts.w_in for p in decay["params"])
    assert any(p is layer.experts.b_in for p in no_decay["params"])
    assert any(p is layer.router.weight for p in decay["params"])


def test_tflops_and_mfu_in_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE recipe reports TFLOP/s and MFU too, from its own flops_per_batch (experts at top_k / E)."""
    monkeypatch.setenv("LP_PEAK_TFLOPS", "0.5")
    monkeypatch.setattr(sys, "argv", ["recipes.moe"])
    args = ["fit", "--config", str(CONFIGS / "tiny.yaml"), "--trainer.max_steps", "12", "--trainer.log_every_n_steps", "1",
            "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--model.block_size", "32", "--data.batch_size", "4"]  # fmt: skip
    cli = main(args)
    assert cli.model._forward_flops_per_token > 0
    with open(tmp_path / "moe-tiny" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("TFLOP/s") for r in rows) and any(r.get("MFU") for r in rows)
