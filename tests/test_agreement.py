"""Tensors for collectives are made on the device the group's backend takes (NCCL: CUDA only), on CPU too."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.comm.agreement import all_agree, communication_device
from lightning_parallel.tensor_parallel.verify import exact_fp32


@pytest.fixture
def one_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1
        )
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_gloo_takes_cpu_tensors_and_the_vote_is_the_minimum(one_rank_group) -> None:
    assert communication_device(one_rank_group) == torch.device("cpu")
    assert all_agree(True) and not all_agree(False)


def test_nccl_groups_get_cuda_tensors(one_rank_group, monkeypatch: pytest.MonkeyPatch) -> None:
    """The class of mistake NCCL refuses (a CPU flag): the device follows the backend, not the default."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert communication_device(one_rank_group) == torch.device("cuda", 3)


def test_verifications_compare_in_ieee_fp32_and_restore_the_settings() -> None:
    torch.set_float32_matmul_precision("high")
    try:
        with exact_fp32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
