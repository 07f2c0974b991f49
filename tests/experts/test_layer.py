"""The MoE layer in one process: dense equivalence, drops, statistics, grouped matmuls, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.experts import GroupedExperts, MoE, grouped_mm, moe_aux_loss
from lightning_parallel.experts.experts import _padded_bmm
from recipes.gpt.model import MLP, GPTConfig


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)


def test_one_expert_equals_the_dense_mlp_with_the_same_weights() -> None:
    """The recipe GPT's MLP (fc, GELU, proj, with biases) and a 1-expert MoE holding its weights."""
    dense = MLP(GPTConfig(n_embd=16, n_head=2))
    moe = MoE(16, 64, num_experts=1, top_k=1, capacity_factor=1.0, bias=True)
    moe.experts.load_dense(0, dense.fc, dense.proj)
    x = torch.randn(3, 5, 16)
    x_dense, x_moe = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(3, 5, 16)
    y_dense, y_moe = dense(x_dense), moe(x_moe)
    torch.testing.assert_close(y_moe, y_dense, rtol=1e-5, atol=1e-6)
    (y_dense * grad).sum().backward()
    (y_moe * grad).sum().backward()
    torch.testing.assert_close(x_moe.grad, x_dense.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.experts.w_in.grad[0], dense.fc.weight.grad.t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.experts.w_out.grad[0], dense.proj.weight.grad.t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.experts.b_in.grad[0], dense.fc.bias.grad, rtol=1e-5, atol=1e-6)
    assert float(moe.dropped_fraction) == 0.0 and moe.tokens_per_expert.tolist() == [15.0]


def test_one_swiglu_expert_equals_a_llama_mlp() -> None:
    gate, up, down = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False), nn.Linear(12, 8, bias=False)
    moe = MoE(8, 12, num_experts=1, top_k=1, activation="swiglu")
    moe.experts.load_dense(0, gate, down, fc_up=up)
    x = torch.randn(4, 8)
    torch.testing.assert_close(moe(x), down(F.silu(gate(x)) * up(x)), rtol=1e-5, atol=1e-6)


def test_dropped_assignments_contribute_zero_and_kept_ones_their_weighted_expert() -> None:
    moe = MoE(8, 16, num_experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 10.0  # all tokens prefer expert 0; capacity ceil(6 / 2 * 0.5) = 2
    x = torch.randn(6, 8)
    x[:, 0] = x[:, 0].abs() + 1
    y = moe(x)
    assert torch.all(y[2:] == 0)  # tokens 3.. dropped: the caller's residual passes them on unchanged
    probs = torch.softmax(moe.router(x[:2]), -1)[:, :1]
    expert_0 = moe.experts(x[:2], torch.tensor([2, 0]))
    torch.testing.assert_close(y[:2], expert_0 * probs)
    assert float(moe.dropped_fraction) == pytest.approx(4 / 6)
    assert moe.tokens_per_expert.tolist() == [6.0, 0.0]


def test_statistics_and_aux_loss_taken_once() -> None:
    moe = MoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.5, z_loss_coef=0.1)
    model = nn.Sequential(moe)
    moe(torch.randn(2, 5, 8))
    assert float(moe.tokens_per_expert.sum()) == 2 * 10
    assert float(moe.aux_loss) == pytest.approx(1.0, abs=0.1)  # near-uniform router at init: about 1
    expected = 0.5 * moe.aux_loss + 0.1 * moe.z_loss
    taken = moe_aux_loss(model)
    torch.testing.assert_close(taken.detach(), expected)
    assert taken.requires_grad
    assert float(moe_aux_loss(model)) == 0.0  # counted once
    moe.eval()
    with torch.no_grad():
        moe(torch.randn(2, 5, 8))
    assert float(moe.take_aux_loss()) == 0.0  # evaluation records nothing
    with pytest.raises(ValueError, match="no lightning_parallel MoE layer"):
        moe_aux_loss(nn.Linear(2, 2))


def test_aux_loss_gradient_reaches_the_router() -> None:
    moe = MoE(8, 16, num_experts=4, top_k=2)
    moe(torch.randn(10, 8))
    moe.take_aux_loss().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert moe.experts.w_in.grad is None


@pytest.mark.parametrize("counts", [[3, 0, 4], [0, 0, 5], [0, 0, 0], [2, 2, 2]])
def test_grouped_mm_equals_a_loop_and_the_padded_fallback(counts: list[int]) -> None:
    counts_E = torch.tensor(counts)
    x = torch.randn(sum(counts), 5, requires_grad=True)
    w = torch.randn(3, 5, 7, requires_grad=True)
    want = torch.cat([x_e @ w[e] for e, x_e in enumerate(x.split(counts))])
    got = grouped_mm(x, w, counts_E)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_padded_bmm(x, w, counts_E), want)
    got.sum().backward()  # an expanded gradient (strides 0): grouped_mm's backward needs it contiguous
    w_grad = w.grad.clone()
    w.grad = None
    want.sum().backward()
    torch.testing.assert_close(w_grad, w.grad)


def test_bf16_autocast_runs_the_experts_in_bf16() -> None:
    moe = MoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(torch.randn(2, 3, 8))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 8)
    assert moe.router(torch.randn(3, 8)).dtype == torch.float32


def test_zero_tokens() -> None:
    moe = MoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0)
    y = moe(torch.randn(0, 8, requires_grad=True))
    assert y.shape == (0, 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_experts=4, top_k=5), "top_k=5"),
        (dict(num_experts=4, top_k=0), "top_k=0"),
        (dict(num_experts=0, top_k=1), "num_experts=0"),
        (dict(num_experts=4, top_k=2, capacity_factor=0.0), "capacity_factor=0.0"),
        (dict(num_experts=4, top_k=2, capacity_factor=-1.0), "capacity_factor=-1.0"),
        (dict(num_experts=4, top_k=2, token_order="random"), "token_order='random'"),
    ],
)
def test_bad_input_raises_value_error_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(8, 16, **kwargs)


def test_bad_activation_and_top1_normalisation_warning() -> None:
    with pytest.raises(ValueError, match="activation='tanh'"):
        GroupedExperts(8, 16, 2, activation="tanh")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="no gradient"):
        MoE(8, 16, num_experts=2, top_k=1, normalize_top_k=True)
