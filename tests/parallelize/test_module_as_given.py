"""The recipe starts from the user's whole, materialised model, and says so where it is not (issue 38)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.parallelize.recipe import check_module_as_given


def test_meta_parameters_are_refused_with_the_fix() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=r"4 parameters are on the meta device \(first: `0.weight`\).*init_weights="
    ):
        check_module_as_given(model)
    check_module_as_given(nn.Sequential(nn.Linear(4, 4)))  # the control: a real model passes


def test_a_model_sharded_by_hand_is_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh))
    with pytest.raises(ValueError, match=r"already sharded \(`0.weight` is a DTensor\).*`plan=`"):
        check_module_as_given(model)
    wrapped = nn.Sequential(nn.Linear(4, 4))
    fully_shard(wrapped[0], mesh=mesh)
    with pytest.raises(ValueError, match="already sharded"):
        check_module_as_given(wrapped)


def test_init_module_creates_real_parameters_even_with_empty_init() -> None:
    from lightning_parallel import HybridParallelStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(), logger=False)
    with trainer.init_module(empty_init=True):
        model = nn.Linear(4, 4)
    assert not model.weight.is_meta  # Lightning's ModelParallelStrategy puts it on the meta device


class _BuiltInConfigureModel(L.LightningModule):
    def __init__(self, meta: bool) -> None:
        super().__init__()
        self.meta = meta
        self.layer: nn.Module | None = None

    def configure_model(self) -> None:
        if self.layer is None:
            with torch.device("meta") if self.meta else torch.device("cpu"):
                self.layer = nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        assert self.layer is not None
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("meta", [True, False])
def test_a_meta_model_from_configure_model_is_refused_through_the_trainer(meta: bool) -> None:
    """The refusal comes at setup, before the model moves to the device (whose own error on a meta tensor says
    nothing of the fix); the control, the same model with real tensors, trains."""
    from lightning_parallel import HybridParallelStrategy

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=HybridParallelStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = _BuiltInConfigureModel(meta)
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    if meta:
        with pytest.raises(
            ValueError, match=r"2 parameters are on the meta device \(first: `layer.weight`\)"
        ):
            trainer.fit(model, data)
    else:
        trainer.fit(model, data)
        assert trainer.global_step == 1
