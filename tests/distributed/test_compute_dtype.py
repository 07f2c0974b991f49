"""The compute-dtype record and the GPU's autocast checks on the CPU, in one process (no process group).

The record (tests/distributed/compute_dtype.py) counts every product of the forward and of recomputed
forwards in the dtype autocast or the weights gave it, leaves the backward's own out, sets the fp32 the
model chose on purpose apart, and fails a precision on any product in another dtype. DeepSpeed's
``autocast_if_enabled`` made to see the CPU (tests/distributed/gpu_checks.py) switches Lightning's autocast
off for an engine config without ``torch_autocast``, as it does on a GPU; the engine config built for
``bf16-mixed`` keeps it on. The same in real runs: tests/distributed/test_parity_zero.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel.experts.router import Router
from tests.distributed.compute_dtype import ComputeDtypeCounter, compute_dtype_problems, summarize
from tests.distributed.gpu_checks import gpu_checks_on_the_cpu, patched_modules


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.gate = nn.Linear(8, 16), nn.Linear(16, 8), Router(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).relu()
        scores = h @ h.transpose(-1, -2)  # a product of activations, not of weights
        return self.down(scores.softmax(-1) @ h) + self.gate(x).sum(-1, keepdim=True)


def _record(module: nn.Module, dtype: torch.dtype | None, recompute: bool = False) -> dict[str, int]:
    x = torch.randn(2, 4, 8, dtype=next(module.parameters()).dtype)  # "-true": inputs cast as the plugin does
    counter = ComputeDtypeCounter()
    counter.counting = True
    with counter, torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = checkpoint(module, x, use_reentrant=False) if recompute else module(x)
        y.float().sum().backward()
    return dict(counter.counts)


def test_every_product_of_the_forward_and_its_recomputation_counts_in_its_dtype() -> None:
    torch.manual_seed(0)
    block = _Block()
    mixed = summarize(_record(block, torch.bfloat16, recompute=True))
    # up, two activation products, down (forward and recomputed); the gate in fp32 on purpose (not recomputed:
    # torch stops recomputing once backward has what it saved, the gate's inputs); no product of the backward.
    assert mixed == {
        "forward": {"bfloat16": 4},
        "recomputed": {"bfloat16": 4},
        "fp32_by_design": {"float32": 1},
    }
    assert compute_dtype_problems(_record(block, torch.bfloat16), "bf16-mixed") == []
    assert compute_dtype_problems(_record(block, None), "32-true") == []
    half = _record(_Block().to(torch.float16), None)  # "16-true": the weights' dtype, no autocast
    assert compute_dtype_problems(half, "16-true") == [] and summarize(half)["forward"] == {"float16": 4}


def test_a_product_in_another_dtype_fails_the_record() -> None:
    """Negative controls: an fp32 run judged as bf16-mixed, one linear taken out of autocast, an empty record."""
    block = _Block()
    fp32 = _record(block, None)
    assert compute_dtype_problems(fp32, "32-true") == []
    (problem,) = compute_dtype_problems(fp32, "bf16-mixed")
    assert "computed 4 of 4 matrix products in another dtype than bfloat16" in problem

    class _OneOut(_Block):  # autocast switched off around one linear (not a product kept fp32 on purpose)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                out = self.up(x.float())
            return super().forward(x) + out[..., :8]

    (problem,) = compute_dtype_problems(_record(_OneOut(), torch.bfloat16), "bf16-mixed")
    assert "computed 1 of 5" in problem  # all of them in bf16, not most
    assert compute_dtype_problems({}, "32-true")  # nothing recorded: the record itself did not engage


class _Engine:
    """What DeepSpeed's ``autocast_if_enabled`` asks of its engine, from the config ZeRO builds."""

    def __init__(self, config: dict) -> None:
        self.config = config.get("torch_autocast", {})

    def torch_autocast_enabled(self) -> bool:
        return bool(self.config.get("enabled"))

    def torch_autocast_dtype(self) -> torch.dtype:
        return getattr(torch, self.config.get("dtype", "float32"))


@pytest.mark.parametrize("section", [True, False], ids=["issue_33_config", "config_before_issue_33"])
def test_deepspeed_switches_the_autocast_off_without_its_section_when_its_check_sees_the_cpu(
    section: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deepspeed.runtime.torch_autocast as ta

    from lightning_parallel.config.arguments import zero as zero_arguments
    from lightning_parallel.zero import arguments

    monkeypatch.setattr(ta, "_WARNED_NESTED_AUTOCAST", True)  # its warning asks deepspeed.comm for a rank
    if not section:
        monkeypatch.setitem(arguments.ZERO_PRECISIONS, "bf16-mixed", None)
    engine = _Engine(zero_arguments(2, None, None, None).deepspeed_config("bf16-mixed", None))
    linear = nn.Linear(8, 8)

    def dtype_inside_the_engine(emulate: bool) -> torch.dtype:
        with gpu_checks_on_the_cpu(emulate) as patched, torch.autocast("cpu", dtype=torch.bfloat16):
            assert patched == (["deepspeed.runtime.torch_autocast"] if emulate else [])
            with ta.autocast_if_enabled(engine):
                return linear(torch.randn(2, 8)).dtype

    # As on a GPU: the fixed config computes in bf16, the old one in fp32 (issue 33).
    assert dtype_inside_the_engine(True) == (torch.bfloat16 if section else torch.float32)
    assert (
        dtype_inside_the_engine(False) == torch.bfloat16
    )  # as shipped, on a CPU: the old config hid the bug
    assert patched_modules() == []  # left as found


def test_products_on_fake_tensors_are_shape_propagation_not_compute() -> None:
    """torch 2.11's DTensor runs an op's first call on fake tensors (metadata only) before the real local product:
    the fake one is left out, the real one counts. Negative control: the same fp32 product on real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = ComputeDtypeCounter()
    counter.counting = True
    with counter, FakeTensorMode():
        torch.randn(4, 8) @ torch.randn(8, 4)
    assert summarize(dict(counter.counts)) == {}
    with counter:
        torch.randn(4, 8) @ torch.randn(8, 4)
    assert summarize(dict(counter.counts)) == {"forward": {"float32": 1}}
