"""Rank functions of the expert-parallel tests (run by ``tests.experts.spawn.run_ranks``).

Every rank builds the same layer and the same global batch, computes the single-process
reference itself (cheap at this size), then runs its part under expert parallelism and
compares. The global batch is split as ``DistributedSampler`` splits data (rank r gets samples
r, r + R, ...), or contiguously for ``token_order="rank_major"``.

Losses: the reference is ``sum(y * G) + aux`` on the whole batch; rank r uses
``sum(y_r * G_r) + aux_r / R`` (``aux_r`` is scaled so that the ranks' mean is the global aux),
so the SUM over ranks of every gradient equals the reference gradient. Expert gradients need no
reduction at all (all tokens of the group reach the expert's one holder).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.experts import ExpertParallel, MoE, expert_parameters, expert_shard

RTOL, ATOL = 1e-5, 1e-6


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _split(x: torch.Tensor, rank: int, world: int, order: str) -> torch.Tensor:
    if order == "rank_major":
        return x.chunk(world)[rank]
    return x[rank::world]


def _summed(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def _inputs(batch: int, seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(batch, seq, dim, generator=gen), torch.randn(batch, seq, dim, generator=gen)


def _aux_of(module: nn.Module) -> torch.Tensor:
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    return torch.stack([m.take_aux_loss() for m in layers]).sum() if layers else torch.zeros(())


def check_parity(
    rank: int,
    world: int,
    build: Callable[[], nn.Module],
    order: str = "sample_interleaved",
    batch: int = 4,
    seq: int = 6,
    expect_drops: bool | None = None,
    per_rank_differs: bool = False,
    skew: int | None = None,
) -> dict:
    """Outputs, input gradients, every parameter gradient and the statistics equal the reference."""
    torch.manual_seed(0)
    reference = build()
    layer_dim = next(p for p in reference.parameters() if p.dim() == 2).shape[-1]
    X, G = _inputs(batch, seq, layer_dim)
    if skew is not None:
        _route_all_to(reference, skew)
        X[..., 0] = X[..., 0].abs() + 1.0
    layer = copy.deepcopy(reference)
    # single-process reference on the global batch
    X_ref = X.clone().requires_grad_()
    y_ref = reference(X_ref)
    y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
    ((y_ref * G).sum() + _aux_of(reference)).backward()
    # this rank's part, experts sharded over all ranks, statistics over all ranks
    group = dist.group.WORLD
    ExpertParallel.apply(layer, group, token_group=group)
    x = _split(X, rank, world, order).clone().requires_grad_()
    y = layer(x)
    y = y[0] if isinstance(y, tuple) else y
    ((y * _split(G, rank, world, order)).sum() + _aux_of(layer) / world).backward()

    _close("output", y, _split(y_ref, rank, world, order))
    _close("input gradient", x.grad, _split(X_ref.grad, rank, world, order))
    ref_params = dict(reference.named_parameters())
    experts = expert_parameters(layer)
    assert experts, "no expert parameters found"
    for name, param in layer.named_parameters():
        want = ref_params[name].grad
        shard = expert_shard(param)
        if shard is not None and shard.dim == 0:
            want = want[shard.first_expert : shard.first_expert + shard.num_local]
            _close(f"gradient of expert parameter {name}", param.grad, want)
        elif shard is not None:  # a ModuleList expert: whole tensor, one holder
            _close(f"gradient of expert parameter {name}", param.grad, want)
        else:
            _close(f"gradient of replicated parameter {name}", _summed(param.grad), want)
    stats = {}
    for (name, ref_mod), mod in zip(reference.named_modules(), layer.modules(), strict=True):
        if isinstance(ref_mod, MoE):
            _close(f"{name} tokens_per_expert", mod.tokens_per_expert, ref_mod.tokens_per_expert)
            _close(f"{name} dropped_fraction", mod.dropped_fraction, ref_mod.dropped_fraction)
            _close(f"{name} aux_loss (mean over ranks)", _summed(mod.aux_loss) / world, ref_mod.aux_loss)
            _close(f"{name} z_loss (mean over ranks)", _summed(mod.z_loss) / world, ref_mod.z_loss)
            stats = {"dropped": float(ref_mod.dropped_fraction), "load": ref_mod.tokens_per_expert.tolist()}
            if expect_drops is not None:
                assert (stats["dropped"] > 0) == expect_drops, stats
    if per_rank_differs:
        # The same layer with capacity per rank (no token group) must NOT match: the test above
        # would catch a capacity computed per rank instead of over the global batch.
        local = copy.deepcopy(reference)
        ExpertParallel.apply(local, group)
        y_local = local(_split(X, rank, world, order))
        differs = torch.tensor(float(not torch.allclose(y_local, _split(y_ref, rank, world, order).detach())))
        dist.all_reduce(differs)
        assert differs > 0, "per-rank capacity gives the same result: the drop test is not meaningful"
    return stats


# ---- layers ---------------------------------------------------------------------------------------


def moe(**kwargs) -> Callable[[], nn.Module]:
    """A picklable builder of a small ``MoE`` (width 16, experts of width 24)."""
    return functools.partial(MoE, 16, 24, **{"num_experts": 4, "top_k": 2, "z_loss_coef": 0.001, **kwargs})


@torch.no_grad()
def _route_all_to(module: nn.Module, expert: int) -> None:
    """Every token's first choice is ``expert`` (inputs get feature 0 >= 1); the others tie at 0."""
    for layer in module.modules():
        if isinstance(layer, MoE):
            layer.router.weight.zero_()
            layer.router.weight[expert, 0] = 50.0


def run_all(rank: int, world: int, cases: dict[str, dict]) -> dict[str, str | dict]:
    """Run ``check_parity(**case)`` for every case; per case its statistics or its traceback.

    A case failing on one rank only (an assertion) does not desynchronise the others: every
    collective of a case happens before its assertions... except the last ones, so a failed
    case is followed by a barrier that resynchronises the ranks.
    """
    import traceback

    out: dict[str, str | dict] = {}
    for name, case in cases.items():
        try:
            out[name] = check_parity(rank, world, **case)
        except AssertionError:
            out[name] = traceback.format_exc()
        dist.barrier()
    return out
