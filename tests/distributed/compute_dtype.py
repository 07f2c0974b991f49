"""The compute-dtype record: the dtype every matmul of the training forward (and of any recomputed forward) ran in.

A run asked for ``bf16-mixed`` that computes in fp32 matches its one-process reference all the same
when the reference computes in fp32 too, and within the low-precision tolerance even when it does not
(issue 33: DeepSpeed's engine switched an outer autocast off, on a GPU, and the whole step ran in
fp32). So every harness run, distributed or reference, counts from each batch's start to its optimizer
step the matrix products its rank computed (:class:`ComputeDtypeCounter`), by phase and output dtype,
and the parity checks require ALL of them in the dtype the precision asks for
(:func:`compute_dtype_problems`), not "at least one":

- a torch dispatch mode sees the kernels autocast chose, after its casts (``aten.mm``, ``addmm``,
  ``bmm``, ``baddbmm``, the fused attention kernels, ``_grouped_mm``, convolutions): ``nn.Linear``,
  ``F.linear``, ``torch.matmul`` and ``einsum`` decompose into these before a dispatch mode sees them;
- DTensor is let run first (``NotImplemented``), so a sharded layer counts the local products each rank
  computes;
- phases: ``forward`` (no autograd node is running), ``recomputed`` (an autograd node is running and grad
  mode is on: activation checkpointing re-running a forward inside backward); the backward's own
  products (grad mode off inside a node) are not counted;
- a product the model computes in fp32 on purpose is counted apart, as ``fp32_by_design``: inside
  :data:`FP32_BY_DESIGN` (the MoE gate, rotary angles, the fp32 statistics of ring attention), named
  with the reason, so the exemption is a list a reviewer reads, never "whatever ran in fp32".
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "EXPECTED_DTYPES",
    "FP32_BY_DESIGN",
    "MATMUL_OPS",
    "ComputeDtypeCounter",
    "compute_dtype_problems",
    "summarize",
]

# The kernels a matrix product reaches on the CPU (and on a GPU: the flash/efficient/cudnn attention).
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_grouped_mm", "_scaled_mm",
    "convolution", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})  # fmt: skip

_MATMUL_PACKETS = frozenset(
    getattr(torch.ops.aten, name) for name in MATMUL_OPS if hasattr(torch.ops.aten, name)
)

# What a precision computes its products in.
EXPECTED_DTYPES = {
    "32-true": "float32",
    "32": "float32",
    "bf16-mixed": "bfloat16",
    "bf16-true": "bfloat16",
    "16-mixed": "float16",
    "16-true": "float16",
    "fp8": "bfloat16",  # torchao's emulated float8 linears under bf16 autocast (tests/distributed/worker.py)
}

# Code that computes in fp32 whatever the precision, on purpose: ``co_qualname`` suffix -> why.
FP32_BY_DESIGN = {
    "Router.forward": "lightning_parallel.experts.router: the MoE gate in fp32 (top-k ties in bf16)",
    "RotaryEmbedding.forward": "transformers: rotary angles in fp32 (positions beyond bf16's integers)",
}

_MAX_DEPTH = 80


def _by_design() -> str | None:
    """The :data:`FP32_BY_DESIGN` entry the current Python stack is inside, if any."""
    frame = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        qualname = frame.f_code.co_qualname
        for suffix in FP32_BY_DESIGN:
            if qualname.endswith(suffix):
                return suffix
        frame = frame.f_back
    return None


class ComputeDtypeCounter(TorchDispatchMode):
    """Counts the matrix products of the forward and of recomputed forwards, by phase, kernel and dtype.

    ``counts`` keys are ``"<phase>.<kernel>.<dtype>"`` (``"forward.addmm.bfloat16"``); see the module
    docstring. Counts while ``counting`` is set (the worker sets it at a batch's start and clears it before
    the optimizer steps); the same instance accumulates over the run. ``collectives``: a
    ``CollectiveCounter`` (tests/distributed/engagement.py) fed every operator while this mode is entered,
    so that a distributed run pays one dispatch mode for both records (each costs about half a step).
    """

    def __init__(self, collectives: Any = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.counting = False
        self.collectives = collectives
        self.recomputed_ops = 0
        """Every operator run again in backward (any kind): selective recomputation's cheap ops show here."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(t is not torch.Tensor and issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if self.collectives is not None:
            self.collectives.observe(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.counting and torch.is_grad_enabled():
            node = torch._C._current_autograd_node()
            # A forward op run again: inside a node that unpacks what it saved (a gradient hook runs in
            # AccumulateGrad: DeepSpeed's views of the parameters it reduces are no recomputation).
            if node is not None and "AccumulateGrad" not in node.name():
                self.recomputed_ops += 1
        if self.counting and func.overloadpacket in _MATMUL_PACKETS:
            in_node = torch._C._current_autograd_node() is not None
            if not in_node or torch.is_grad_enabled():  # the backward's own products are not counted
                first = out[0] if isinstance(out, (tuple, list)) else out
                if type(first).__name__ == "FakeTensor":
                    # shape propagation, no product computed: torch 2.11's DTensor runs an op's first call on fake
                    # tensors built from its specs' metadata (which, for FSDP2's bf16-gathered tensor-parallel
                    # weights, still says fp32 there); the real local product follows and is counted
                    return out
                dtype = str(first.dtype).removeprefix("torch.")
                phase = "recomputed" if in_node else "forward"
                if dtype == "float32" and _by_design() is not None:
                    phase = "fp32_by_design"
                self.counts[f"{phase}.{func.overloadpacket.__name__}.{dtype}"] += 1
        return out


def summarize(counts: dict[str, int]) -> dict[str, dict[str, int]]:
    """``{phase: {dtype: count}}`` of a record."""
    out: dict[str, dict[str, int]] = {}
    for key, count in counts.items():
        phase, _, dtype = key.split(".")
        out.setdefault(phase, {})
        out[phase][dtype] = out[phase].get(dtype, 0) + count
    return out


def compute_dtype_problems(counts: dict[str, int], precision: str, who: str = "the run") -> list[str]:
    """Products of ``counts`` not in the dtype ``precision`` asks for; a record without products is one too."""
    expected = EXPECTED_DTYPES.get(str(precision))
    if expected is None:
        return [
            f"{who}: no compute dtype is known for precision {precision!r} (tests/distributed/compute_dtype.py)"
        ]
    judged = {k: v for k, v in counts.items() if not k.startswith("fp32_by_design.")}
    if not any(k.startswith("forward.") for k in judged):
        return [f"{who}: no matrix product recorded in the training forward ({dict(counts)})"]
    wrong = {k: v for k, v in judged.items() if k.rsplit(".", 1)[1] != expected}
    if not wrong:
        return []
    total = sum(judged.values())
    return [
        f"{who} asked for {precision} computed {sum(wrong.values())} of {total} matrix products in another dtype"
        f" than {expected}: {dict(sorted(wrong.items()))} (all: {summarize(counts)})"
    ]
