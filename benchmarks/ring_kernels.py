"""The ring attention's blocks on one device: which kernel ran, how close to torch's own attention, how fast.

    PYTHONPATH=. python -m benchmarks.ring_kernels                 # the lent GPU: 16 heads x 128, 2 x 8192 tokens
    PYTHONPATH=. python -m benchmarks.ring_kernels --tiny --cpu    # the same code paths in seconds

Context parallelism splits a sequence over ranks; each rank's queries meet the keys chunk by chunk
(``lightning_parallel/context_parallel/ring.py``) and the blocks' partial results merge by their
log-sum-exp. No process group is needed to check the blocks: here the second half of a causal
sequence's queries meets the first half's keys whole and its own causally, two blocks, merged, as a
rank of a two-rank ring computes them. On a GPU they run torch's CUDA flash kernel where it agreed
with the math at first use (``context_parallel/cuda_blocks.py``), else the fp32 math. Printed and
written (``--json``): the kernel the blocks used, the largest difference of the merged output and of
the input gradients from ``F.scaled_dot_product_attention`` over the whole sequence (in fp32 as the
exact value, and in bf16 beside it: the rounding any bf16 kernel has), and the forward+backward time
of the blocks, of the math path, and of torch's attention over the whole sequence (the one-device
peer; it does four thirds of the blocks' work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import machine, table
from lightning_parallel.context_parallel import ring
from lightning_parallel.context_parallel.blocks import Block

SHAPES = {
    "tiny": dict(batch=1, heads=4, length=128, width=64),
    "gpu": dict(batch=1, heads=16, length=16384, width=128),
}


def two_ring_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor
) -> list[torch.Tensor]:
    """The second half's output and the input gradients, from the two blocks a rank of a two-rank ring computes."""
    half, scale = q.shape[-2] // 2, q.shape[-1] ** -0.5
    late = slice(half, None)
    blocks = [(Block(1, 0, False), slice(0, half)), (Block(1, 1, True), late)]
    b, h, _, d = q.shape
    total: ring.Partial = (torch.zeros(b, h, half, d, device=q.device),
                           torch.full((b, h, half), float("-inf"), device=q.device))  # fmt: skip
    for block, keys in blocks:
        total = ring._merge(total, ring._attend(q[:, :, late], k[:, :, keys], v[:, :, keys], block, scale))
    out, lse = total
    dq = torch.zeros(b, h, half, d, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)
    for block, keys in blocks:
        parts = ring._attend_backward(grad[:, :, late], q[:, :, late], k[:, :, keys], v[:, :, keys],
                                      out.to(q.dtype), lse, block, scale)  # fmt: skip
        dq += parts[0].float()
        dk[:, :, keys] += parts[1].float()
        dv[:, :, keys] += parts[2].float()
    return [out, dq, dk, dv]


def whole_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor
) -> list[torch.Tensor]:
    """torch's attention over the whole causal sequence: the second half's output and the same gradients."""
    half = q.shape[-2] // 2
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    full_grad = torch.zeros_like(out)
    full_grad[:, :, half:] = grad[:, :, half:]
    out.backward(full_grad)
    assert leaves[0].grad is not None and leaves[1].grad is not None and leaves[2].grad is not None
    return [out[:, :, half:].detach(), leaves[0].grad[:, :, half:], leaves[1].grad, leaves[2].grad]


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest difference of any of the four, relative to that tensor's largest magnitude."""
    return max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max())
        for a, b in zip(got, want, strict=True)
    )


def run(shape: dict[str, Any], device: torch.device, repeats: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    dims = (shape["batch"], shape["heads"], shape["length"], shape["width"])
    q, k, v, grad = (torch.randn(dims, generator=generator).to(device, torch.bfloat16) for _ in range(4))
    exact = whole_sequence(*(t.float() for t in (q, k, v, grad)))
    blocks = two_ring_blocks(q, k, v, grad)
    kernel = ("torch's fused CPU kernel" if ring.fused(device) else "torch's CUDA flash kernel"
              if ring._flash_on_gpu(q, Block(1, 1, True)) else "the fp32 math")  # fmt: skip
    flash, fused_cpu = ring.flash_takes, ring.fused
    ring.flash_takes = lambda q, bias: False  # type: ignore[assignment]
    ring.fused = lambda device: False  # type: ignore[assignment]
    try:
        math = two_ring_blocks(q, k, v, grad)
        math_s = _time(lambda: two_ring_blocks(q, k, v, grad), device, repeats)
    finally:
        ring.flash_takes, ring.fused = flash, fused_cpu  # type: ignore[assignment]
    result = {
        "kernel": kernel,
        "flash_on_gpu": kernel == "torch's CUDA flash kernel",
        "blocks_vs_exact": _difference(blocks, exact),
        "torch_bf16_vs_exact": _difference(
            whole_sequence(q, k, v, grad), exact
        ),  # the rounding of a bf16 kernel
        "math_vs_exact": _difference(math, exact),
        "blocks_s": _time(lambda: two_ring_blocks(q, k, v, grad), device, repeats),
        "math_s": math_s,
        "torch_whole_s": _time(lambda: whole_sequence(q, k, v, grad), device, repeats),
    }
    result["blocks_over_torch"] = result["blocks_s"] / result["torch_whole_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    shape = SHAPES["tiny" if args.tiny or device.type == "cpu" else "gpu"]
    print(f"# ring_kernels: {shape}, bf16, {device}; {machine()}", flush=True)
    result = run(shape, device, args.repeats)
    print(f"blocks computed with {result['kernel']}")
    print(table(["", "largest difference from fp32 attention", "forward + backward"], [
        ["ring blocks", f"{result['blocks_vs_exact']:.2e}", f"{result['blocks_s'] * 1e3:.2f} ms"],
        ["ring blocks, fp32 math", f"{result['math_vs_exact']:.2e}", f"{result['math_s'] * 1e3:.2f} ms"],
        ["torch SDPA, whole sequence, bf16", f"{result['torch_bf16_vs_exact']:.2e}",
         f"{result['torch_whole_s'] * 1e3:.2f} ms"],
    ]))  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"shape": shape, "device": str(device), **result}, handle, indent=1)


if __name__ == "__main__":
    main()
