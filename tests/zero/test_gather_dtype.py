"""``zero_gather_dtype="compute"``: FSDP2 gathers 16-bit copies of the shards (parity: tests/distributed/test_parity_zero.py,
the ``_gcompute`` cases; refusals: tests/zero/test_arguments.py; the planner's bytes: tests/planner/test_timing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_parallel.config.arguments import zero as zero_arguments
from tests.doc_examples import run_doc_example
from tests.environment import ROOT


def test_compute_gathers_pick_fsdp2_and_its_policy() -> None:
    """The option runs ZeRO on FSDP2 whatever the layout (DeepSpeed's engine has no such cast), with a policy that
    gathers in the compute dtype, reduces in fp32 and leaves the blocks' inputs alone; 'stored' casts nothing."""
    from lightning_parallel.zero.engine_choice import engine_for
    from lightning_parallel.zero.fsdp import gather_dtype_for, gather_policy

    compute = zero_arguments(3, None, None, None, gather_dtype="compute")
    assert engine_for(compute, tensor_parallel=1) == "fsdp2"
    assert engine_for(zero_arguments(3, None, None, None), tensor_parallel=1) == "deepspeed"
    assert gather_dtype_for(compute, "bf16-mixed") is torch.bfloat16
    assert gather_dtype_for(compute, "16-mixed") is torch.float16
    assert gather_dtype_for(zero_arguments(3, None, None, None), "bf16-mixed") is None
    policy = gather_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    assert gather_policy(None).param_dtype is None


@pytest.mark.timeout(300)
def test_the_docs_example_runs_and_keeps_fp32_shards(tmp_path: Path) -> None:
    out = run_doc_example(ROOT / "docs" / "zero.md", tmp_path, heading="## 16-bit gathers on FSDP2")
    assert "gathered in ['torch.bfloat16']" in out  # with zero_gather_dtype="stored": ['torch.float32']
    assert "DTensor torch.float32 (96, 64) of (192, 64)" in out


class _TwoHeads(torch.nn.Module):
    """A block whose second projection is used only when asked: its first gradient can come in a later micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if use_b else y


def _accumulate_with_a_late_gradient(rank: int, world_size: int, fixed: bool) -> None:
    """Two micro-batches, the first without reduction and without ``b``: FSDP2 reduces an fp32 accumulator (``a``)
    beside a fresh bf16 gradient (``b``). The reduced gradients are the rule's: each micro-batch's gradient of the
    bf16 copies, summed in fp32, averaged over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.zero import fsdp

    torch.manual_seed(0)
    root = torch.nn.Sequential(_TwoHeads())
    copies = [(n, p.detach().clone()) for n, p in root[0].named_parameters()]
    if not fixed:  # the negative control: FSDP2 as torch ships it
        fsdp.fsdp_accumulate_in_reduce_dtype = lambda unit: None
    mesh = init_device_mesh("cpu", (world_size,))
    fsdp.fully_shard_modules(root, mesh, [root[0]], offload=False, gather_dtype=torch.bfloat16)
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    block = root[0]
    for i, x in enumerate(inputs):
        block.set_requires_gradient_sync(i == 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block(x, use_b=i == 1).float().sum().backward()
    # the rule in one process: bf16 copies of the weights, each micro-batch's gradient summed in fp32
    expected = {n: torch.zeros_like(v) for n, v in copies}
    for i, x in enumerate(inputs):
        weights = {n: v.bfloat16().requires_grad_() for n, v in copies}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.func.functional_call(block.__class__(), weights, (x,), {"use_b": i == 1})
        out.float().sum().backward()
        for n, w in weights.items():
            if w.grad is not None:
                expected[n] += w.grad.float()
    for n in expected:
        torch.distributed.all_reduce(expected[n])
        expected[n] /= world_size
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[n], rtol=0, atol=0, msg=n)


@pytest.mark.timeout(120)
def test_a_gradient_that_first_comes_in_the_reducing_micro_batch_joins_the_fp32_accumulators() -> None:
    from tests.precision import spawn_gloo

    spawn_gloo(_accumulate_with_a_late_gradient, 2, True)


@pytest.mark.timeout(120)
def test_without_the_fp32_move_fsdp2_refuses_the_mixed_gradients() -> None:
    """Negative control: torch's FSDP2 alone asserts one gradient dtype for the reduce-scatter."""
    from tests.precision import spawn_gloo

    with pytest.raises(Exception, match="uniform gradient dtype"):
        spawn_gloo(_accumulate_with_a_late_gradient, 2, False)
