"""Model FLOPs counted from an unchanged module's shapes (``plans/flops.py``), and the device peak for MFU."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.plans.flops import (
    PEAK_ENV,
    forward_flops_per_token,
    peak_flops,
    training_flops_per_token,
)


def test_gpt_count_is_6n_plus_12ldt() -> None:
    """The count MFU is quoted in (PaLM, nanoGPT, benchmarks/gpu_step.py): 6 N + 12 L d T per token."""
    from recipes.gpt.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    with torch.device("meta"):
        model = GPT(config)
    reference = 6 * model.num_params() + 12 * 24 * 2048 * 2048
    counted = training_flops_per_token(model, 2048)
    assert counted == pytest.approx(reference, rel=1e-3)  # N also holds biases and norm gains: 0.04%
    assert counted != pytest.approx(6 * model.num_params(), rel=1e-2)  # attention is counted


def test_attention_grows_with_the_sequence() -> None:
    from recipes.gpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=320, block_size=128, n_layer=2, n_head=4, n_embd=64))
    short, long = forward_flops_per_token(model, 64), forward_flops_per_token(model, 128)
    assert long - short == pytest.approx(2 * 4 * 64 * 64)  # 2 layers x 4 x (128 - 64) x d_attn=64


def test_experts_count_top_k_of_num_experts() -> None:
    """A token meets top_k of the experts: one more expert per token adds exactly one expert's matmuls."""
    from recipes.moe.module import MoEGPTLightningModule

    def count(top_k: int) -> float:
        torch.manual_seed(0)
        module = MoEGPTLightningModule(n_layer=2, n_embd=64, num_experts=4, top_k=top_k, expert_hidden=128)
        return forward_flops_per_token(module.model, 128)

    one_expert_matmuls = 2 * (64 * 128 + 128 * 64)  # w_in and w_out of one expert, per MoE layer
    assert count(2) - count(1) == pytest.approx(2 * one_expert_matmuls)  # 2 MoE layers


def test_peak_from_the_environment_and_none_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setenv(PEAK_ENV, "989.5")
    assert peak_flops(torch.device("cpu"), torch.bfloat16) == pytest.approx(989.5e12)
