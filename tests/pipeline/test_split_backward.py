"""torch 2.11's split weight pass (the zero-bubble schedules) and a parameter a stage uses twice (issue 39).

torch's own split passes against the full backward, on the installed torch: exact on 2.13; on 2.11 wrong where a
parameter has several consumers (run in the side environment of docs/design.md, "torch versions"). The refusal
is checked on both by answering the version gate as 2.11 does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_parallel import compat
from lightning_parallel.pipeline import split_backward
from lightning_parallel.pipeline.split_backward import check_split_backward, parameters_used_more_than_once


class _MatrixTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).tanh() @ self.w


class _BlockTwice(nn.Module):  # ALBERT-style: one block applied twice
    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.block(self.block(self.a(x)).relu()).relu())


class _Once(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def _split_error(module: nn.Module) -> float:
    """torch's input pass then weight pass against the full backward: the largest weight-gradient difference."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    params = list(module.parameters())
    full = torch.autograd.grad(module(x), params, grad)
    _, groups = stage_backward_input([module(x)], [grad], [x], iter(params))
    stage_backward_weight(iter(params), groups)
    return max(float((p.grad - f).abs().max()) for p, f in zip(params, full, strict=True))


@pytest.mark.parametrize("make", [_MatrixTwice, _BlockTwice, _Once], ids=lambda m: m.__name__)
def test_the_gate_says_when_the_split_weight_pass_is_exact(make: type[nn.Module]) -> None:
    torch.manual_seed(0)
    module = make()
    used = parameters_used_more_than_once([module(torch.randn(4, 8, requires_grad=True))], module)
    assert bool(used) is (make is not _Once)
    exact = _split_error(module) < 1e-6
    assert exact or not compat.split_weight_backward_exact()  # 2.13: exact always
    assert exact or used  # 2.11: wrong only where a parameter is used twice (what the refusal looks for)


def test_a_stage_using_a_parameter_twice_is_refused_where_the_weight_pass_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    shared, once = _BlockTwice(), _Once()
    outputs = lambda m: [m(torch.randn(4, 8, requires_grad=True))]  # noqa: E731
    assert parameters_used_more_than_once(outputs(shared), shared) == ["block.bias", "block.weight"]
    if compat.split_weight_backward_exact():  # the installed torch's gate: 2.13 has nothing to refuse
        check_split_backward(outputs(shared), shared, 0)
    else:
        with pytest.raises(ValueError, match="stage 0 uses"):
            check_split_backward(outputs(shared), shared, 0)
    monkeypatch.setattr(split_backward, "split_weight_backward_exact", lambda: False)  # as torch 2.11 answers
    with pytest.raises(
        ValueError, match=r"stage 1 uses block\.bias, block\.weight more than once.*torch>=2\.13"
    ):
        check_split_backward(outputs(shared), shared, 1)
    check_split_backward(outputs(once), once, 1)  # a parameter used once: exact on 2.11 too
