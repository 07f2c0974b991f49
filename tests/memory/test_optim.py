"""Optimizer state of the recipe GPT: Adafactor and torchao's 8-bit AdamW against AdamW (measured).

AdamW keeps two fp32 moments per parameter element. Adafactor keeps, per weight matrix n x m,
a row vector (n) and a column vector (m) of second moments and no first moment; per vector
parameter one second moment per element. Both keep a 0-dim fp32 step per parameter.
"""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_parallel.optim import Adafactor, low_bit_adamw, optimizer_state_bytes


def recipe_gpt() -> torch.nn.Module:
    from recipes.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randint(128, (2, 32), generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    optimizer.step()


def test_adafactor_state_against_adamw() -> None:
    sizes = {}
    for name, make in (("AdamW", torch.optim.AdamW), ("Adafactor", Adafactor)):
        model = recipe_gpt()
        optimizer = make(model.parameters())
        one_step(model, optimizer)
        sizes[name] = optimizer_state_bytes(optimizer)
    params = list(recipe_gpt().parameters())
    steps = 4 * len(params)
    assert sizes["AdamW"] == 2 * 4 * sum(p.numel() for p in params) + steps
    factored = sum((p.shape[0] + p.shape[1]) if p.dim() == 2 else p.numel() for p in params)
    assert sizes["Adafactor"] == 4 * factored + steps
    print(f"\noptimizer state, recipe GPT (2 layers, width 64): AdamW {sizes['AdamW']} bytes,"
          f" Adafactor {sizes['Adafactor']} bytes ({sizes['Adafactor'] / sizes['AdamW']:.1%})")  # fmt: skip
    assert sizes["Adafactor"] < sizes["AdamW"] / 20


def test_adafactor_plain_tensors_step_exactly_as_torch() -> None:
    a, b = recipe_gpt(), recipe_gpt()
    oa, ob = torch.optim.Adafactor(a.parameters(), lr=1e-2), Adafactor(b.parameters(), lr=1e-2)
    for _ in range(2):
        one_step(a, oa)
        one_step(b, ob)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_low_bit_adamw_state_is_a_quarter_of_adamw() -> None:
    model = recipe_gpt()
    adamw = torch.optim.AdamW(model.parameters())
    one_step(model, adamw)
    model = recipe_gpt()
    eight_bit = low_bit_adamw(model.parameters(), bits=8)  # eager on CPU (compile only on a GPU)
    one_step(model, eight_bit)
    full, small = optimizer_state_bytes(adamw), optimizer_state_bytes(eight_bit)
    print(f"\nAdamW {full} bytes, 8-bit AdamW {small} bytes ({small / full:.1%})")
    # torchao quantizes tensors of >= 4096 elements (1 byte + a scale per block of 256); smaller stay fp32.
    assert small < full / 3


def test_low_bit_adamw_refuses_unknown_bits() -> None:
    with pytest.raises(ValueError, match="`bits=3` must be 8, 4 or 'fp8'"):
        low_bit_adamw(recipe_gpt().parameters(), bits=3)  # type: ignore[arg-type]


def test_low_bit_adamw_without_torchao_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install --no-deps torchao"):
        low_bit_adamw(recipe_gpt().parameters())
