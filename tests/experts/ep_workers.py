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
    for name, param in experts.items():
        shard = expert_shard(param)
        assert shard is not None and shard.ep_size == world, f"{name} was not sharded: {shard}"
        if shard.dim == 0:
            assert param.shape[0] == shard.num_local == shard.num_experts // world, (name, param.shape, shard)
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
    converted = dict(layer.named_modules())
    for name, ref_mod in reference.named_modules():
        mod = converted.get(name)
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
        case = dict(case)
        fn = case.pop("fn", check_parity)
        try:
            out[name] = fn(rank, world, **case)
        except Exception:  # the assertions, and errors of the code under test
            out[name] = traceback.format_exc()
        dist.barrier()
    return out


# ---- foreign blocks ---------------------------------------------------------------------------


@torch.no_grad()
def _init(module: nn.Module) -> nn.Module:
    """HF blocks built outside ``from_pretrained``/``post_init`` hold ``torch.empty`` weights."""
    for param in module.parameters():
        param.normal_(std=0.2)
    return module


def hf_mixtral_block(implementation: str = "eager") -> nn.Module:
    """transformers 5's ``MixtralSparseMoeBlock``: router ``gate`` + fused ``MixtralExperts``."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                           experts_implementation=implementation)  # fmt: skip
    return _init(MixtralSparseMoeBlock(config))


def hf_qwen2_moe_block(implementation: str = "eager") -> nn.Module:
    """transformers 5's ``Qwen2MoeSparseMoeBlock``: fused experts plus a gated shared expert."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                            experts_implementation=implementation)  # fmt: skip
    return _init(Qwen2MoeSparseMoeBlock(config))


class LegacyExpert(nn.Module):
    """transformers 4's ``MixtralBlockSparseTop2MLP``, as written there."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class LegacySparseMoE(nn.Module):
    """transformers 4's ``MixtralSparseMoeBlock`` (router + ModuleList, a loop over experts).

    ``shared=True`` adds Qwen2-MoE's gated shared expert and ``norm_topk_prob=False``.
    """

    def __init__(
        self, dim: int = 16, hidden: int = 24, num_experts: int = 4, top_k: int = 2, shared: bool = False
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([LegacyExpert(dim, hidden) for _ in range(num_experts)])
        self.shared = shared
        if shared:
            self.norm_topk_prob = False
            self.shared_expert = LegacyExpert(dim, hidden)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if not self.shared:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        expert_mask = nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = self.experts[expert_idx](current) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        if self.shared:
            final = final + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(
                hidden_states
            )
            return final.reshape(batch_size, sequence_length, hidden_dim)
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


def legacy_block(shared: bool = False) -> nn.Module:
    return _init(LegacySparseMoE(shared=shared))


def tiny_mixtral(num_layers: int = 2) -> nn.Module:
    """A whole ``MixtralForCausalLM`` from a tiny config (vocabulary 64, width 16, 4 experts, top-2)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=num_layers,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def check_hf_model(rank: int, world: int, coef: float = 0.02) -> dict:
    """A whole Mixtral under ep=world equals one process, auxiliary loss (collector) included."""
    from lightning_parallel.experts import AuxLossCollector

    reference = tiny_mixtral()
    model = copy.deepcopy(reference)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(64, (2 * world, 8), generator=gen)
    G = torch.randn(2 * world, 8, 64, generator=gen)
    collector = AuxLossCollector(reference, coef=coef, z_loss_coef=1e-3)
    collector.reset()
    logits = reference(ids).logits
    loss = collector.add_to_loss((logits * G).sum())
    loss.backward()
    ref_aux = float(loss.detach() - (logits * G).sum().detach())

    group = dist.group.WORLD
    ExpertParallel.apply(model, group, token_group=group)
    collector = AuxLossCollector(model, coef=coef, z_loss_coef=1e-3, token_group=group)
    collector.reset()
    logits_r = model(ids[rank::world]).logits
    main = (logits_r * G[rank::world]).sum()
    aux_r = collector.add_to_loss(torch.zeros(())) / world
    (main + aux_r).backward()
    _close("logits", logits_r, logits[rank::world])
    _close("aux loss (summed over ranks)", _summed(aux_r.detach()), torch.tensor(ref_aux))
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        shard = expert_shard(param)
        want = ref_params[name].grad
        if shard is not None:
            _close(
                f"gradient of {name}",
                param.grad,
                want[shard.first_expert : shard.first_expert + shard.num_local],
            )
        else:
            _close(f"gradient of {name}", _summed(param.grad), want)
    return {"aux": ref_aux, "expert_params": sorted(expert_parameters(model))}


def check_bad_input(rank: int, world: int) -> dict:
    """Experts not divisible by the ep size: ``ValueError`` naming the block, nothing changed."""
    import pytest

    layer = MoE(8, 8, num_experts=3, top_k=1)
    before = layer.experts.w_in
    with pytest.raises(ValueError, match="3 experts, which expert_parallel=2 does not divide"):
        ExpertParallel.apply(layer, dist.group.WORLD)
    assert layer.experts.w_in is before and layer.ep_group is None
    block = legacy_block()
    ExpertParallel.apply(block, dist.group.WORLD)
    with pytest.raises(ValueError, match="already expert-parallel"):
        ExpertParallel.apply(block, dist.group.WORLD)
    return {}


def check_gradient_reduction(rank: int, world: int, expert_parallel: bool) -> dict:
    """Mean losses, data-parallel averaging: expert grads summed over replicas / dp size == reference.

    ``expert_parallel=True``: ep=world (one ep group, no replicas); ``False``: ep=1, every rank
    holds all experts and the replica group is the world.
    """
    from lightning_parallel.experts import reduce_expert_gradients

    torch.manual_seed(0)
    reference = MoE(16, 24, num_experts=4, top_k=2, capacity_factor=1.0)
    layer = copy.deepcopy(reference)
    X, G = _inputs(2 * world, 6, 16)
    (reference(X) * G).mean().backward()
    group = dist.group.WORLD
    ExpertParallel.apply(layer, group if expert_parallel else None, token_group=group)
    (layer(X[rank::world]) * G[rank::world]).mean().backward()
    experts = expert_parameters(layer)
    reduce_expert_gradients(list(experts.values()), None if expert_parallel else group, world)
    ref_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        want = ref_params[name].grad
        if name in experts:
            shard = expert_shard(param)
            _close(
                f"gradient of {name}",
                param.grad,
                want[shard.first_expert : shard.first_expert + shard.num_local],
            )
        else:
            _close(f"gradient of {name}", _summed(param.grad) / world, want)
    return {}
