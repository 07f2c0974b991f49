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
    assert "DTensor torch.float32 (96, 64) of (192, 64)" in out
