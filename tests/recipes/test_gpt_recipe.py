"""Single-process tests of the GPT recipe: tokenizer, data, model, module, callbacks, CLI, prepare.

Everything runs on CPU in well under a minute; nothing touches the network.
"""

from __future__ import annotations

import csv
import gzip
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

import recipes.gpt.prepare as prepare_mod
from recipes.gpt import GPT, ByteTokenizer, GPTConfig, GPTLightningModule, TokenDataModule, TokensPerSecond
from recipes.gpt.__main__ import main
from recipes.gpt.callbacks import (
    CountedFlopsSummary,
    StepLimitedProgressBar,
    data_parallel_replicas,
    sequences_in_batch,
    tokens_in_batch,
)
from recipes.gpt.data import TokenWindows, load_embedded_corpus
from recipes.gpt.make_corpus import make_corpus
from recipes.gpt.module import warmup_cosine

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=320, block_size=32, n_layer=2, n_head=4, n_embd=64)


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_including_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "Hello, world! héllo wörld — 日本語 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert len(ids) > len(text)  # multi-byte characters take several tokens
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_tensor(text)) == text
    assert tok.encode_tensor(text).dtype == torch.long


def test_tokenizer_decode_never_raises_on_model_samples() -> None:
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 300, 319]) == "hi"  # padded-vocab ids are dropped
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a cut multi-byte char


# ---------------------------------------------------------------------------- data


def test_token_windows_shift_and_count() -> None:
    tokens = np.arange(2 * 8 + 1 + 3, dtype=np.uint16)  # 20 tokens
    windows = TokenWindows(tokens, block_size=8)
    assert len(windows) == (20 - 1) // 8 == 2
    for i in range(len(windows)):
        x, y = windows[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (8,)
        assert torch.equal(x, torch.arange(i * 8, i * 8 + 8))
        assert torch.equal(y, x + 1)  # y is x shifted by one token
    with pytest.raises(IndexError):
        windows[2]
    with pytest.raises(ValueError, match="block_size"):
        TokenWindows(tokens[:8], block_size=8)


def test_embedded_corpus_loads_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the embedded corpus must not touch the network")

    monkeypatch.setattr(socket, "socket", no_network)
    tokens = load_embedded_corpus()
    assert 1_000_000 < len(tokens) < 2_100_000
    assert tokens.dtype == np.uint16 and tokens.max() < 256
    assert "Once upon a time" in ByteTokenizer().decode(tokens[:20_000].tolist())


def test_embedded_corpus_is_reproducible_from_make_corpus() -> None:
    shipped = gzip.decompress((REPO_ROOT / "recipes/gpt/data/corpus.txt.gz").read_bytes()).decode("utf-8")
    assert shipped == make_corpus()
    assert make_corpus(5_000, seed=1) == make_corpus(5_000, seed=1) != make_corpus(5_000, seed=2)


def test_datamodule_split_and_batches() -> None:
    dm = TokenDataModule(block_size=32, batch_size=4, shuffle=False)
    dm.setup("fit")
    num_tokens = len(load_embedded_corpus())
    assert len(dm.val_set) == pytest.approx(0.05 * num_tokens / 32, rel=0.01)
    assert len(dm.train_set) == pytest.approx(0.95 * num_tokens / 32, rel=0.01)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[0], dm.train_set[0][0])  # shuffle=False: windows in order
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="val_fraction"):
        TokenDataModule(val_fraction=1.0)


# ---------------------------------------------------------------------------- model


def test_model_output_shape_and_tied_head() -> None:
    model = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 256, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 320)
    assert model.lm_head.weight is model.transformer.wte.weight
    # the tied matrix is counted once
    assert model.num_params(non_embedding=False) == sum(p.numel() for p in set(model.parameters()))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_config_validation_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--model.n_head"):
        GPTConfig(n_embd=65, n_head=4)


# ---------------------------------------------------------------------------- module


def test_warmup_cosine_schedule() -> None:
    lr = [warmup_cosine(s, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1) for s in range(130)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[10] == pytest.approx(1.0) and lr[60] == pytest.approx(0.55)
    assert lr[110] == lr[129] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:], strict=False))  # monotone decay


def test_weight_decay_groups() -> None:
    module = GPTLightningModule(**TINY, lr_decay_steps=100)
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert any(p is module.model.lm_head.weight for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # no Trainer here, on purpose
def test_a_few_steps_reduce_the_loss_on_a_fixed_batch() -> None:
    torch.manual_seed(0)
    module = GPTLightningModule(**TINY, learning_rate=3e-3, warmup_steps=1, lr_decay_steps=100)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    tokens = torch.from_numpy(load_embedded_corpus()[: 8 * 32 + 1].astype(np.int64))
    batch = (tokens[:-1].view(8, 32), tokens[1:].view(8, 32))
    losses = []
    for step in range(15):
        loss = module.training_step(batch, step)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    assert losses[0] == pytest.approx(np.log(320), abs=0.3)  # starts near uniform
    assert losses[-1] < losses[0] - 1.0


def test_generate_appends_tokens() -> None:
    module = GPTLightningModule(**TINY).eval()
    prompt = ByteTokenizer().encode_tensor("Once upon")[None]  # (1, T)
    out = module.generate(prompt, max_new_tokens=20, temperature=0.8, top_k=5)
    assert out.shape == (1, prompt.size(1) + 20)
    assert torch.equal(out[:, : prompt.size(1)], prompt)
    greedy = [module.generate(prompt, 5, temperature=0) for _ in range(2)]
    assert torch.equal(greedy[0], greedy[1])


def test_trainer_fit_and_validate_fast_dev_run() -> None:
    module = GPTLightningModule(**TINY, warmup_steps=1)
    dm = TokenDataModule(block_size=32, batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        fast_dev_run=2,
        callbacks=[TokensPerSecond(window=2)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2
    assert trainer.progress_bar_metrics["tok/s"] > 0
    assert "train_loss" in trainer.progress_bar_metrics
    (metrics,) = trainer.validate(module, datamodule=dm, verbose=False)
    assert metrics["val_ppl"] == pytest.approx(np.exp(metrics["val_loss"]), rel=1e-3)


# ---------------------------------------------------------------------------- callbacks


def test_throughput_functions_and_replica_count() -> None:
    batch = (torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))
    assert sequences_in_batch(batch) == 4 and tokens_in_batch(batch) == 64
    single = SimpleNamespace(strategy=SimpleNamespace())  # no distributed_sampler_kwargs: one replica
    assert data_parallel_replicas(single) == 1
    # e.g. 8 ranks as tp=4 x dp=2: the sampler sees 2 replicas, not the world size 8
    dp2 = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}))
    assert data_parallel_replicas(dp2) == 2
    with pytest.raises(ValueError):
        TokensPerSecond(window=0)


# ---------------------------------------------------------------------------- prepare and CLI


def test_prepare_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "First line\r\nSecond: naïve café 🙂\n" * 50
    src, dst = tmp_path / "input.txt", tmp_path / "out" / "tokens.bin"
    src.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(prepare_mod, "CHUNK_CHARS", 7)  # chunk boundaries inside the text
    prepare_mod.main([str(src), str(dst)])
    tokens = np.memmap(dst, dtype=np.uint16, mode="r")
    assert len(tokens) == len(text.encode("utf-8"))
    assert ByteTokenizer().decode(tokens.tolist()) == text  # bytes kept, \r\n included
    dm = TokenDataModule(data_path=str(dst), block_size=16, batch_size=2, val_fraction=0.2)
    dm.setup("fit")
    x, y = dm.train_set[0]
    assert ByteTokenizer().decode(x) == text[:16]
    with pytest.raises(ValueError, match="prepare"):
        TokenDataModule(data_path=str(tmp_path / "missing.bin")).setup("fit")


def test_cli_fit_tiny_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In process, through the same `main` that `python -m recipes.gpt` calls: a subprocess
    # would spend ~10 s re-importing torch and Lightning on a 2-core machine.
    args = [
        "fit",
        "--config", str(REPO_ROOT / "recipes/gpt/configs/tiny.yaml"),
        "--trainer.max_steps", "3",
        "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["recipes.gpt"])  # not pytest's own arguments
    cli = main(args)
    assert cli.trainer.global_step == 3
    assert cli.datamodule.block_size == cli.model.hparams.block_size == 64  # linked by the CLI
    run_dir = tmp_path / "gpt-tiny" / "version_0"
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(row["train_loss"] for row in rows) and any(row["tok/s"] for row in rows)
    # The model summary's "Total FLOPs" is the recipe's count (Lightning's own read 0 without an example
    # input), and the bar leaves out the logger's version (the rich bar printed it as "v_num: 0.000").
    (summary,) = [c for c in cli.trainer.callbacks if isinstance(c, CountedFlopsSummary)]
    flops = summary._summary(cli.trainer, cli.model).total_flops
    assert flops == cli.model.forward_flops_per_sequence > 0
    assert "v_num" in ProgressBar().get_metrics(cli.trainer, cli.model)  # Lightning's bar shows it
    assert "v_num" not in StepLimitedProgressBar().get_metrics(cli.trainer, cli.model)


def test_tflops_and_mfu_on_the_bar_and_in_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TFLOP/s (and MFU, given a peak) logged from the module's ``flops_per_batch``; no ThroughputMonitor
    warning about it; the epoch field of a step-limited run reads "Epoch 0", not "Epoch 0/-2"."""
    import warnings

    from lightning.pytorch.callbacks import RichProgressBar

    from recipes.gpt.callbacks import StepLimitedProgressBar

    monkeypatch.setenv("LP_PEAK_TFLOPS", "0.5")  # a CPU has no known peak: TFLOP/s only, unless told
    monkeypatch.setattr(sys, "argv", ["recipes.gpt"])
    args = [
        "fit", "--config", str(REPO_ROOT / "recipes/gpt/configs/tiny.yaml"), "--trainer.max_steps", "12",
        "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "2",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    ]  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli = main(args)
    assert not [w for w in seen if "flops_per_batch" in str(w.message)]
    bar = cli.trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar):  # Lightning's default from 2.6 (2.5's tqdm bar shows no "/-2")
        assert isinstance(bar, StepLimitedProgressBar) and bar._get_train_description(0).strip() == "Epoch 0"
    module = cli.model
    tokens = 16 * 64  # the tiny config's batch x block size, one rank
    cli.trainer.training = True  # forward and backward; evaluation counts the forward alone
    assert module.flops_per_batch == pytest.approx(3 * tokens * module._forward_flops_per_token)
    cli.trainer.validating = True
    assert module.flops_per_batch == pytest.approx(tokens * module._forward_flops_per_token)
    with open(tmp_path / "gpt-tiny" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    tflops = [float(r["TFLOP/s"]) for r in rows if r.get("TFLOP/s")]
    mfu = [float(r["MFU"]) for r in rows if r.get("MFU")]
    assert tflops and mfu and all(t > 0 for t in tflops)
    assert mfu[-1] == pytest.approx(tflops[-1] / 0.5, rel=1e-6)
    assert any(r.get("train/device/flops_per_sec") for r in rows)  # Lightning's ThroughputMonitor, fed too
