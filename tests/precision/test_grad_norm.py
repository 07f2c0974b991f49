"""Global gradient norm and clipping: sharded over gloo processes vs. the same maths in one process.

Every distributed check compares with ``torch.nn.utils`` on the full (unsharded) gradients,
which each rank builds itself from the same seed: "one process" without an extra process.
One spawn per world size runs every check, because starting processes dominates the time.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_parallel.precision.grad_norm import clip_grad_norm_, clip_grad_value_, global_grad_norm
from tests.precision import spawn_gloo

RTOL = 1e-6
NORM_TYPES = (2.0, 3.0, math.inf)


# ---------------------------------------------------------------- single process, plain tensors


def _plain_params(seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((4, 3), (5,), (2, 2, 2))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf, "inf"])
def test_plain_tensors_match_torch(norm_type: float | str) -> None:
    params = _plain_params()
    expected = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    torch.testing.assert_close(global_grad_norm(params, norm_type), expected, rtol=RTOL, atol=0)

    reference = _plain_params()
    torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type)
    returned = clip_grad_norm_(params, 0.5, norm_type)
    torch.testing.assert_close(returned, expected, rtol=RTOL, atol=0)
    for param, ref in zip(params, reference, strict=True):
        torch.testing.assert_close(param.grad, ref.grad, rtol=RTOL, atol=1e-7)


def test_skips_missing_grads_and_counts_repeats_once() -> None:
    params = _plain_params()
    no_grad = nn.Parameter(torch.ones(3))
    expected = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.testing.assert_close(global_grad_norm([*params, no_grad, params[0]]), expected, rtol=RTOL, atol=0)
    before = params[0].grad.clone()
    clip_grad_norm_([params[0], params[0]], max_norm=1e-3)  # scaled once, not twice
    torch.testing.assert_close(params[0].grad.norm(), torch.tensor(1e-3), rtol=1e-4, atol=0)
    assert torch.allclose(params[0].grad / before, params[0].grad[0, 0] / before[0, 0])
    assert no_grad.grad is None


def test_empty_and_low_precision() -> None:
    assert global_grad_norm([]).item() == 0.0
    assert global_grad_norm([nn.Parameter(torch.ones(2))], math.inf).item() == 0.0
    param = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    param.grad = torch.full((4096,), 1.0, dtype=torch.bfloat16)
    norm = global_grad_norm([param])
    assert norm.dtype == torch.float32  # accumulated in float32, not bf16
    assert norm.item() == 64.0


def test_clip_value_and_bad_arguments() -> None:
    params = _plain_params()
    clip_grad_value_(params, 0.1)
    assert all(p.grad.abs().max() <= 0.1 for p in params)
    with pytest.raises(ValueError, match="norm_type=0"):
        global_grad_norm(params, 0)
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


# ---------------------------------------------------------------- distributed


class _Net(nn.Module):
    """x * gain (a plain parameter) -> up (colwise) -> down (rowwise, to sequence shards)
    -> norm (sequence parallel: replicated weights, Partial grads) -> head (colwise)."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(dim))
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.down(torch.relu(self.up(x * self.gain)))))


def _tp_net(tp_mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[Tensor]]:
    """The sharded net's parameters (after backward) and the full grads of the same net in one process."""
    torch.manual_seed(0)
    reference, sharded = _Net(), _Net()
    sharded.load_state_dict(reference.state_dict())
    plan = {
        "up": ColwiseParallel(),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(sharded, tp_mesh, plan)
    x = torch.randn(2, 4, 8)
    reference(x).pow(2).mean().backward()
    sharded(x).pow(2).mean().backward()
    params = list(sharded.parameters())
    assert (
        isinstance(sharded.norm.weight.grad, DTensor) and sharded.norm.weight.grad.placements[0].is_partial()
    )
    assert not isinstance(sharded.gain, DTensor)
    return params, [p.grad for p in reference.parameters()]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


def _tp_replicated_block(mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[Tensor]]:
    """The strategy's own layout: TP on ``tp``, then torch's FSDP2 ``replicate`` over ``dp``.

    The norm ends up a DTensor on the 1-D ``dp`` mesh, the linears on the 2-D mesh: the mix
    on which ``torch.nn.utils.clip_grad_norm_`` fails ("must have the same mesh").
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    torch.manual_seed(0)
    reference, sharded = _Block(), _Block()
    sharded.load_state_dict(reference.state_dict())
    parallelize_module(sharded, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    replicate(sharded, mesh=mesh["dp"])
    x = torch.randn(4, 3, 8)
    dp_rank = mesh.get_local_rank("dp")
    sharded(x[2 * dp_rank : 2 * dp_rank + 2]).pow(2).mean().backward()  # each replica half the batch
    reference(x).pow(2).mean().backward()
    meshes = {p.grad.device_mesh for p in sharded.parameters() if isinstance(p.grad, DTensor)}
    assert len(meshes) == 2, meshes
    return list(sharded.parameters()), [p.grad for p in reference.parameters()]


_SYNTHETIC_2D = [  # placements on the (dp, tp) mesh, full shape
    ((Replicate(), Shard(0)), (6, 4)),  # TP-sharded, replicated over dp
    ((Replicate(), Shard(0)), (5, 3)),  # uneven shards
    ((Replicate(), Shard(0)), (1, 3)),  # an empty shard on tp rank 1
    ((Shard(0), Shard(1)), (4, 6)),  # sharded over both axes (FSDP x TP)
    ((Shard(1), Replicate()), (3, 4)),
    ((Replicate(), Replicate()), (5,)),
    ((Replicate(), Partial()), (4,)),
]


def _synthetic(mesh: DeviceMesh, specs: list, seed: int) -> tuple[list[nn.Parameter], list[Tensor]]:
    """DTensor parameters with given grad placements, and the full grads they represent."""
    generator = torch.Generator().manual_seed(seed)
    params, full_grads = [], []
    for placements, shape in specs:
        full = torch.randn(shape, generator=generator)
        addend = torch.randn(shape, generator=generator)
        param = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Replicate()] * mesh.ndim))
        if any(p.is_partial() for p in placements):
            # Two addends that sum to the full grad: rank 0 of the axis holds full - addend.
            axis = mesh.ndim - 1
            if mesh.size(axis) == 1:
                local = full
            else:
                local = full - addend if mesh.get_local_rank(axis) == 0 else addend
            param.grad = DTensor.from_local(local, mesh, placements, run_check=False)
        else:
            param.grad = distribute_tensor(full, mesh, placements)
        params.append(param)
        full_grads.append(full)
    return params, full_grads


def _local(grad: Tensor, full: Tensor) -> tuple[Tensor, Tensor]:
    """(this rank's piece of ``grad``, the same piece cut from ``full``): compared without collectives."""
    if not isinstance(grad, DTensor):
        return grad, full
    expected = full
    for mesh_dim, placement in enumerate(grad.placements):
        assert not placement.is_partial(), "Partial grads must have been reduced"
        if placement.is_shard():
            pieces = torch.chunk(expected, grad.device_mesh.size(mesh_dim), dim=placement.dim)
            index = grad.device_mesh.get_local_rank(mesh_dim)
            # torch.chunk returns fewer pieces than asked when the dim is short: empty shards.
            empty = expected.narrow(placement.dim, expected.size(placement.dim), 0)
            expected = pieces[index] if index < len(pieces) else empty
    return grad.to_local(), expected


def _check(params: list[nn.Parameter], full_grads: list[Tensor]) -> None:
    """Norms for every p and clipped grads against torch on the full grads; restores grads between runs."""
    saved = [p.grad.clone() if p.grad is not None else None for p in params]
    for norm_type in NORM_TYPES:
        for param, grad in zip(params, saved, strict=True):
            param.grad = None if grad is None else grad.clone()
        expected = torch.nn.utils.get_total_norm(full_grads, norm_type)
        reference = [nn.Parameter(torch.zeros_like(g)) for g in full_grads]
        for ref, grad in zip(reference, full_grads, strict=True):
            ref.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(reference, 0.5 * expected.item(), norm_type)

        norm = global_grad_norm(params, norm_type)
        assert not isinstance(norm, DTensor)
        torch.testing.assert_close(norm, expected, rtol=RTOL, atol=0, msg=f"norm_type={norm_type}")
        returned = clip_grad_norm_(params, 0.5 * expected.item(), norm_type)
        torch.testing.assert_close(returned, expected, rtol=RTOL, atol=0)
        for param, ref in zip(params, reference, strict=True):
            if param.grad is not None:
                torch.testing.assert_close(*_local(param.grad, ref.grad), rtol=RTOL, atol=1e-7)


class _CountAllReduce:
    """Counts ``torch.distributed.all_reduce`` calls (the ones grad_norm issues itself)."""

    def __enter__(self) -> _CountAllReduce:
        self.count, self._original = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _worker(rank: int, world_size: int) -> None:
    # 1. TP model (+ replicated sequence-parallel norm, + plain parameter), and on 4 ranks
    #    replicated over dp and mixed with parameters on the 2-D (dp, tp) mesh.
    dp = world_size // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    params, full_grads = _tp_net(mesh["tp"])
    if world_size == 4:
        extra, extra_grads = _synthetic(mesh, _SYNTHETIC_2D, seed=1)
        params, full_grads = params + extra, full_grads + extra_grads
    else:  # a shard whose grad is None on rank 0 only: it still joins the collectives
        extra, extra_grads = _synthetic(mesh["tp"], [((Shard(0),), (4, 2)), ((Shard(0),), (1, 3))], seed=1)
        extra_grads[0][:2] = 0
        if rank == 0:
            extra[0].grad = None
        params, full_grads = params + extra, full_grads + extra_grads
    with _CountAllReduce() as counter:
        global_grad_norm(params)
    # One for the Partial grads of the tp axis, one per sharded axis (tp; dp on 4 ranks).
    assert counter.count == (3 if world_size == 4 else 2), counter.count
    _check(params, full_grads)

    if world_size == 4:
        _check(*_tp_replicated_block(mesh))

    # 2. Pipeline stages holding different parameters: norms summed over the pp group.
    pp_mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "tp"))
    stage = pp_mesh.get_local_rank("pp")
    stages = [
        [((Shard(0),), (6, 4)), ((Replicate(),), (3,))],
        [((Shard(1),), (4, 4)), ((Partial(),), (5,)), ((Replicate(),), (2, 2))],
    ]
    all_full: list[Tensor] = []
    own: list[int] = []
    mine: list[nn.Parameter] = []
    for index, specs in enumerate(stages):
        stage_params, stage_grads = _synthetic(pp_mesh["tp"], specs, seed=10 + index)
        if index == stage:
            own = list(range(len(all_full), len(all_full) + len(stage_grads)))
            mine = stage_params
        all_full += stage_grads
    plain = nn.Parameter(torch.zeros(3))  # a plain, stage-local parameter
    plain.grad = torch.full((3,), float(stage + 1))
    all_full.append(torch.full((3,), 1.0))
    all_full.append(torch.full((3,), 2.0))
    own.append(len(all_full) - 2 + stage)
    _check_stage(mine + [plain], all_full, own, pp_mesh["pp"].get_group())


def _check_stage(params: list[nn.Parameter], all_full: list[Tensor], own: list[int], group) -> None:
    saved = [p.grad.clone() for p in params]
    for norm_type in NORM_TYPES:
        for param, grad in zip(params, saved, strict=True):
            param.grad = grad.clone()
        expected = torch.nn.utils.get_total_norm(all_full, norm_type)
        without_pp = global_grad_norm(params, norm_type)
        assert without_pp < expected or norm_type == math.inf  # the other stage is missing
        torch.testing.assert_close(global_grad_norm(params, norm_type, group), expected, rtol=RTOL, atol=0)
        reference = [nn.Parameter(torch.zeros_like(g)) for g in all_full]
        for ref, grad in zip(reference, all_full, strict=True):
            ref.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_(reference, 0.5 * expected.item(), norm_type)
        clip_grad_norm_(params, 0.5 * expected.item(), norm_type, group)
        for param, index in zip(params, own, strict=True):
            torch.testing.assert_close(*_local(param.grad, reference[index].grad), rtol=RTOL, atol=1e-7)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_matches_single_process(world_size: int) -> None:
    spawn_gloo(_worker, world_size)
