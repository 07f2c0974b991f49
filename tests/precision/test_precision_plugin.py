"""The precision plugins: factory and conversion, autocast and casts, clipping, agreed loss scaling."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_parallel.precision import (
    SUPPORTED_PRECISIONS,
    DistributedGradScaler,
    HybridHalfPrecision,
    HybridMixedPrecision,
    HybridPrecision,
    build_precision_plugin,
    convert_precision_plugin,
)
from tests.precision import spawn_gloo

# ---------------------------------------------------------------- factory and conversion


@pytest.mark.parametrize(
    ("precision", "cls", "lightning_cls"),
    [
        ("32-true", HybridPrecision, Precision),
        ("bf16-mixed", HybridMixedPrecision, MixedPrecision),
        ("16-mixed", HybridMixedPrecision, MixedPrecision),
        ("bf16-true", HybridHalfPrecision, HalfPrecision),
        ("16-true", HybridHalfPrecision, HalfPrecision),
    ],
)
def test_factory_maps_each_precision(precision: str, cls: type, lightning_cls: type) -> None:
    plugin = build_precision_plugin(precision, "cpu")
    assert type(plugin) is cls and isinstance(plugin, lightning_cls)
    assert plugin.precision == precision
    if precision == "16-mixed":
        assert isinstance(plugin.scaler, DistributedGradScaler)
    if precision == "bf16-mixed":
        assert plugin.scaler is None
    assert set(SUPPORTED_PRECISIONS) == {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"}


@pytest.mark.parametrize("precision", ["64-true", "bf16", "fp8", "transformer-engine"])
def test_factory_rejects_unknown_precision(precision: str) -> None:
    with pytest.raises(ValueError, match=f"precision='{precision}'.*Choose one of"):
        build_precision_plugin(precision, "cpu")


def test_convert_lightning_plugins() -> None:
    assert type(convert_precision_plugin(Precision())) is HybridPrecision
    half = convert_precision_plugin(HalfPrecision("bf16-true"))
    assert type(half) is HybridHalfPrecision and half.precision == "bf16-true"
    mixed = convert_precision_plugin(MixedPrecision("bf16-mixed", "cpu"))
    assert type(mixed) is HybridMixedPrecision and (mixed.precision, mixed.device) == ("bf16-mixed", "cpu")

    # The scaler Lightning (or the user) configured keeps its settings.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7, backoff_factor=0.25)
    fp16 = convert_precision_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert isinstance(fp16.scaler, DistributedGradScaler)
    state = fp16.scaler.state_dict()
    assert (state["scale"], state["growth_interval"], state["backoff_factor"]) == (1024.0, 7, 0.25)

    # Idempotent: ours come back as they are, with the groups (re)attached.
    group = object()
    assert convert_precision_plugin(fp16, pipeline_group=group, found_inf_group=group) is fp16  # type: ignore[arg-type]
    assert fp16.pipeline_group is group and fp16.scaler.group is group


def test_convert_refuses_other_plugins() -> None:
    with pytest.raises(ValueError, match=r"DoublePrecision\(precision='64-true'\).*'bf16-mixed'"):
        convert_precision_plugin(DoublePrecision())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_convert_what_the_trainer_chose(precision: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, logger=False, enable_progress_bar=False
    )
    plugin = convert_precision_plugin(trainer.strategy.precision_plugin)
    assert isinstance(plugin, HybridPrecision) and plugin.precision == precision


# ---------------------------------------------------------------- autocast, casts, clipping


def test_bf16_mixed_autocasts_matmuls() -> None:
    plugin = build_precision_plugin("bf16-mixed", "cpu")
    layer = nn.Linear(4, 4)
    with plugin.forward_context():
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32  # mixed: parameters stay fp32


def test_bf16_true_converts_module_and_inputs() -> None:
    plugin = build_precision_plugin("bf16-true", "cpu")
    module = plugin.convert_module(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    batch = plugin.convert_input({"x": torch.randn(2, 4), "ids": torch.arange(2)})
    assert batch["x"].dtype == torch.bfloat16 and batch["ids"].dtype == torch.int64
    with plugin.forward_context():
        assert module(batch["x"]).dtype == torch.bfloat16


def test_plugin_clips_by_global_norm_and_value() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    for m in (model, reference):
        m(x).sum().backward()
    plugin = build_precision_plugin("32-true")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.clip_gradients(optimizer, 0.1, GradClipAlgorithmType.NORM)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-6, atol=1e-8)
    plugin.clip_gradients(optimizer, 0.01, GradClipAlgorithmType.VALUE)
    assert all(p.grad.abs().max() <= 0.01 for p in model.parameters())


def test_scaler_single_process_skips_on_overflow() -> None:
    scaler = DistributedGradScaler("cpu", init_scale=8.0, growth_interval=1000)
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler.scale(param.sum()).backward()
    param.grad[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(2)) and scaler.get_scale() == 4.0
    optimizer.zero_grad()
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.zeros(2)) and scaler.get_scale() == 4.0


# ---------------------------------------------------------------- distributed: the ranks agree


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _fp16_step(plugin: HybridMixedPrecision, model: nn.Module, optimizer, poison: bool, rank: int) -> bool:
    """One scaled step; with ``poison``, an inf in the shard of ``up.weight`` only rank 1 holds.

    Returns whether the parameters changed.
    """
    before = [p.detach().to_local().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).pow(2).mean()
    plugin.scaler.scale(loss).backward()
    if poison and rank == 1:
        model.up.weight.grad.to_local()[0, 0] = float("inf")
    plugin.scaler.unscale_(optimizer)  # as Lightning does, before clipping
    plugin.clip_gradients(optimizer, 1.0, GradClipAlgorithmType.NORM)
    plugin.scaler.step(optimizer)
    plugin.scaler.update()
    after = [p.detach().to_local() for p in model.parameters()]
    return any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


def _worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = parallelize_module(_Net(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin = build_precision_plugin("16-mixed", "cpu")
    plugin.scaler = DistributedGradScaler("cpu", init_scale=2.0**10, growth_interval=1000)

    # 1. Overflow in a shard only rank 1 holds: both ranks skip and both back off the scale.
    assert not _fp16_step(plugin, model, optimizer, poison=True, rank=rank)
    assert plugin.scaler.get_scale() == 2.0**9
    # 2. Finite grads: both step, the scale stays.
    assert _fp16_step(plugin, model, optimizer, poison=False, rank=rank)
    assert plugin.scaler.get_scale() == 2.0**9

    # 3. Per-rank plain parameters (pipeline stages); rank 0 has no gradient at all, rank 1 an
    #    inf. torch's GradScaler would let rank 0 step; ours skips on both, without hanging.
    stage_param = nn.Parameter(torch.ones(3))
    stage_optimizer = torch.optim.SGD([stage_param], lr=1.0)
    scaler = DistributedGradScaler("cpu", init_scale=4.0)
    scaler.scale(stage_param.sum()).backward()
    if rank == 0:
        stage_param.grad = None
    else:
        stage_param.grad[1] = float("inf")
    scaler.step(stage_optimizer)
    scaler.update()
    assert torch.equal(stage_param.detach(), torch.ones(3)) and scaler.get_scale() == 2.0

    # 4. The same with a fused optimizer, which unscales inside its own step (another code
    #    path of GradScaler): rank 0's grads are finite, rank 1's are not; both skip.
    fused_param = nn.Parameter(torch.ones(3))
    fused = torch.optim.Adam([fused_param], lr=1.0, fused=True)
    scaler = DistributedGradScaler("cpu", init_scale=4.0)
    scaler.scale(fused_param.sum()).backward()
    if rank == 1:
        fused_param.grad[0] = float("inf")
    scaler.step(fused)
    scaler.update()
    assert torch.equal(fused_param.detach(), torch.ones(3)) and scaler.get_scale() == 2.0

    # 5. bf16 autocast over DTensor layers.
    with build_precision_plugin("bf16-mixed", "cpu").forward_context():
        out = model(torch.randn(2, 4))
    assert (out.to_local() if isinstance(out, DTensor) else out).dtype == torch.bfloat16


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_overflow_decision_agrees_across_ranks() -> None:
    spawn_gloo(_worker, 2)
