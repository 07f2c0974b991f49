"""MoE blocks of unchanged models: detection, adapters (checked in one process), aux-loss collection."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_parallel.experts import AuxLossCollector, MoE, expert_parameters, find_moe_blocks, moe_aux_loss
from lightning_parallel.experts.foreign import check_module_list
from tests.experts import ep_workers as w


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)


def _tiny_qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=12,
                            shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=32)  # fmt: skip
    return Qwen2MoeForCausalLM(config)


def test_finds_hf_mixtral_and_qwen2_moe_blocks() -> None:
    for model, num_experts in ((w.tiny_mixtral(), 4), (_tiny_qwen2_moe(), 4)):
        blocks = find_moe_blocks(model)
        assert [b.name for b in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
        for b in blocks:
            assert (b.kind, b.num_experts, b.top_k, b.router_name, b.experts_name) == (
                "fused",
                num_experts,
                2,
                "gate",
                "experts",
            )
        assert sorted(expert_parameters(model)) == sorted(
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
        )  # the shared expert and the routers are not expert parameters


@pytest.mark.parametrize(("family", "router"), [("ernie4_5_moe", "gate"), ("afmoe", "router")])
def test_finds_routers_with_statistics_or_a_linear_inside(family: str, router: str) -> None:
    """ERNIE 4.5's router holds correction-bias statistics as a child; AFMoE's scores through ``router.gate``."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(family))
    blocks = find_moe_blocks(model)
    assert blocks and {(b.kind, b.num_experts, b.router_name, b.experts_name) for b in blocks} == {
        ("fused", 4, router, "experts")
    }
    # negative control: a router-named module with two linear layers inside says nothing about the experts
    for b in blocks:
        setattr(b.block, router, nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 4)))
    assert find_moe_blocks(model) == []


def test_finds_module_list_blocks_and_this_librarys_layer() -> None:
    model = nn.Sequential(w.LegacySparseMoE(), nn.Linear(16, 16), w.LegacySparseMoE(shared=True))
    blocks = find_moe_blocks(model)
    assert [(b.name, b.kind, b.num_experts, b.top_k, b.router_name) for b in blocks] == [
        ("0", "module_list", 4, 2, "gate"), ("2", "module_list", 4, 2, "gate")
    ]  # fmt: skip
    assert "2.shared_expert.w1.weight" not in expert_parameters(model)
    assert "2.experts.3.w2.weight" in expert_parameters(model)
    layer = MoE(8, 16, num_experts=4, shared_expert_hidden_dim=8)
    info = find_moe_blocks(nn.Sequential(layer))[0]
    assert (info.name, info.kind, info.num_experts) == ("0", "lightning_parallel", 4)
    assert info.expert_param_names == ["0.experts.w_in", "0.experts.w_out"]


def test_no_moe_blocks_in_dense_models() -> None:
    from recipes.gpt.model import GPT, GPTConfig
    from tests.models.hf import HFLlamaModule

    # block_size == n_layer: a position table with as many rows as blocks is not a router
    assert find_moe_blocks(GPT(GPTConfig(vocab_size=64, block_size=2, n_layer=2, n_head=2, n_embd=16))) == []
    assert find_moe_blocks(HFLlamaModule(vocab_size=64, block_size=16)) == []


def test_module_list_check_chooses_normalisation_and_refuses_foreign_routing() -> None:
    plain, shared = find_moe_blocks(nn.Sequential(w.legacy_block(), w.legacy_block(shared=True)))
    check_module_list(plain)
    check_module_list(shared)
    assert (plain.normalize_top_k, plain.returns_logits) == (True, True)
    assert (shared.normalize_top_k, shared.returns_logits) == (False, False)

    class SigmoidRouted(w.LegacySparseMoE):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            x = hidden_states.view(-1, hidden_states.shape[-1])
            weights = torch.sigmoid(self.gate(x))
            return sum(weights[:, i : i + 1] * e(x) for i, e in enumerate(self.experts)).view(
                hidden_states.shape
            )

    (odd,) = find_moe_blocks(nn.Sequential(w._init(SigmoidRouted())))
    with pytest.raises(ValueError, match="routes differently from softmax top-2"):
        check_module_list(odd)


def _hf_aux(logits: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func((logits,), num_experts, top_k)


def test_collector_matches_switch_loss_and_hf_per_layer_up_to_k() -> None:
    model = w.tiny_mixtral(num_layers=1)
    collector = AuxLossCollector(model, coef=1.0)
    ids = torch.randint(64, (2, 8))
    collector.reset()
    out = model(ids, output_router_logits=True)  # labels absent: HF computes its aux but adds nothing
    added = collector.add_to_loss(torch.zeros(()))
    # ours: f sums to 1; Hugging Face's: f sums to k (here 2)
    torch.testing.assert_close(added * 2, out.aux_loss.float(), rtol=1e-5, atol=1e-6)
    assert added.requires_grad
    assert float(collector.add_to_loss(torch.zeros(()))) == 0.0  # consumed: counted once


def test_collector_adds_nothing_when_hf_already_added_its_own() -> None:
    model = w.tiny_mixtral(num_layers=1)
    collector = AuxLossCollector(model, coef=1.0)
    ids = torch.randint(64, (2, 8))
    collector.reset()
    out = model(ids, labels=ids, output_router_logits=True)
    with pytest.warns(UserWarning, match="already added"):
        total = collector.add_to_loss(out.loss)
    assert total is out.loss
    collector.reset()
    out = model(ids, labels=ids)  # config.output_router_logits=False: HF adds nothing, we do
    assert float((collector.add_to_loss(out.loss) - out.loss).detach()) > 0


def test_collector_counts_this_librarys_layers_once() -> None:
    model = nn.Sequential(MoE(8, 16, num_experts=4, aux_loss_coef=0.1), nn.Linear(8, 8))
    collector = AuxLossCollector(model)
    collector.reset()
    model(torch.randn(3, 8))
    want = collector.total()
    assert want is not None and float(want.detach()) > 0
    torch.testing.assert_close(collector.add_to_loss(torch.zeros(())), want)
    collector.reset()
    model(torch.randn(3, 8))
    moe_aux_loss(model)  # the user added it in training_step
    assert float(collector.add_to_loss(torch.zeros(())).detach()) == 0.0
    model.eval()
    with torch.no_grad():
        model(torch.randn(3, 8))
    assert collector.total() is None  # evaluation forwards record nothing


def test_backward_mode_gives_the_same_gradients_as_adding_to_the_loss() -> None:
    ids = torch.randint(64, (2, 8))
    grads = []
    for mode in ("loss", "backward"):
        model = w.tiny_mixtral(num_layers=1)
        collector = AuxLossCollector(model, coef=0.5, z_loss_coef=0.01, mode=mode)
        collector.grad_scale = 0.5  # e.g. two accumulated batches: the main loss is halved too
        collector.reset()
        loss = model(ids).logits.square().mean() * 0.5
        if mode == "loss":
            loss = loss + collector.add_to_loss(torch.zeros(())) * 0.5
        else:
            assert collector.add_to_loss(loss) is loss
        loss.backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad.clone())
        collector.remove()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_collector_bad_input() -> None:
    with pytest.raises(ValueError, match="no MoE block"):
        AuxLossCollector(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode='sideways'"):
        AuxLossCollector(w.legacy_block(), mode="sideways")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AuxLossCollector(w.legacy_block()).remove()


class _Experts(nn.Module):
    """Fused experts called as ``(hidden, top_k_index, top_k_weights)``; ``norm_after=True`` normalises the
    weighted sum (not linear in the routing weights); a per-expert scale sits in a child module (ERGO's norm)."""

    def __init__(self, norm_after: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))
        self.post = nn.Module()
        self.post.scale = nn.Parameter(torch.rand(4, 8) + 0.5)
        self.norm_after = norm_after

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            y = torch.einsum("nh,nhg->ng", x, self.w[index[:, k]]) * self.post.scale[index[:, k]]
            out = out + weights[:, k : k + 1] * y
        return torch.nn.functional.rms_norm(out, (8,)) if self.norm_after else out


class _Block(nn.Module):
    def __init__(self, norm_after: bool = False) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4, bias=False), _Experts(norm_after)
        self.top_k = 2


def test_fused_experts_must_be_linear_in_the_routing_weights() -> None:
    from lightning_parallel.experts.foreign import check_fused_experts

    (info,) = find_moe_blocks(_Block())
    assert info.kind == "fused" and "experts.post.scale" in info.expert_param_names
    check_fused_experts(info)  # weighs each assignment's output: expert parallelism reproduces it
    (info,) = find_moe_blocks(_Block(norm_after=True))
    with pytest.raises(ValueError, match="do not return the sum of each assignment's expert output"):
        check_fused_experts(info)


def test_a_per_expert_weight_inside_a_child_of_the_experts_is_sliced_too() -> None:
    from lightning_parallel.experts.parallel import _slice_stacked

    experts = _Experts()
    full = experts.post.scale.detach().clone()
    _slice_stacked(experts, ["w", "post.scale"], 4, rank=1, size=2)
    assert experts.w.shape[0] == 2 and torch.equal(experts.post.scale, full[2:])  # rank 1 holds experts 2, 3


@pytest.mark.parametrize(
    ("family", "scored"),
    [
        ("inkling_text", 5),
        ("longcat_flash", 6),
        ("zaya", 5),
    ],  # a shared gate, two zero experts, a skip expert
)
def test_a_router_that_declares_its_experts_is_taken_at_its_word(family: str, scored: int) -> None:
    """Routers that score more classes than experts (the block maps the extra ones onto real experts with
    weight 0) or that are a small network of linears (Zaya's) are found by the expert count they declare;
    the negative control, the same router without its declared count, is not taken for one."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(family))
    blocks = find_moe_blocks(model)
    assert blocks and {(b.kind, b.num_experts) for b in blocks} == {("fused", 4)}
    router = blocks[0].router
    assert router is not None
    x = torch.randn(3, model.config.hidden_size)
    assert _router_classes(router, x) == scored
    for b in blocks:
        del b.router.num_experts
    assert find_moe_blocks(model) == []


def _router_classes(router: nn.Module, x: torch.Tensor) -> int:
    linears = [m for m in router.modules() if isinstance(m, nn.Linear)]
    weight = getattr(router, "weight", None)
    return int(linears[-1].out_features if linears else weight.shape[0])


def test_the_aux_loss_drops_a_router_s_classes_beyond_the_experts() -> None:
    """LongCat-Flash's router scores 4 experts and 2 zero experts: the load-balancing loss is Switch's over
    the 4 experts' logits of each call (Hugging Face's per layer, up to k); read as rows of 4 classes, the
    6-class logits give another loss (the negative control)."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("longcat_flash"))
    blocks = find_moe_blocks(model)
    seen: list[torch.Tensor] = []
    for b in blocks:
        b.router.register_forward_hook(
            lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out)
        )
    collector = AuxLossCollector(model, coef=1.0)
    collector.reset()
    model(torch.randint(0, 128, (2, 8)))
    added = collector.add_to_loss(torch.zeros(())).detach()
    top_k = blocks[0].top_k
    assert seen and seen[0].shape[-1] == 6 and top_k is not None
    expected = sum(_hf_aux(s.reshape(-1, 6)[:, :4].detach(), 4, top_k) for s in seen) / top_k
    torch.testing.assert_close(added, expected.float(), rtol=1e-5, atol=1e-6)
    as_rows_of_four = sum(_hf_aux(s.detach().reshape(-1, 4), 4, top_k) for s in seen) / top_k
    assert not torch.allclose(
        added, as_rows_of_four.float(), rtol=1e-3
    )  # a negative control: it must differ by more than rounding, so the tolerance is loose on purpose


def test_experts_stored_as_row_blocks_are_found_and_sliced_by_blocks() -> None:
    """DBRX keeps its experts as 2-D stacks of row blocks one level down (``experts.mlp.w1`` ``(E * F, H)``,
    viewed ``(E, F, H)`` by its code): found with F rows per expert, each rank's slice is its experts' row
    blocks, and the ranks' slices in order rebuild the tensor (what checkpoints write). Sliced as if each row
    were an expert (the negative control) the leading dimension is refused."""
    import copy

    from transformers import AutoModelForCausalLM

    from lightning_parallel.experts.parallel import _slice_stacked, expert_shard
    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("dbrx"))
    info = find_moe_blocks(model)[0]
    assert (info.kind, info.num_experts, info.rows_per_expert) == ("fused", 4, 128)
    names = [n.rpartition("experts.")[2] for n in info.expert_param_names]
    assert names == ["mlp.w1", "mlp.v1", "mlp.w2"]
    whole = info.experts.mlp.w1.detach().clone()
    slices = []
    for rank in range(2):
        experts = copy.deepcopy(info.experts)
        _slice_stacked(experts, names, 4, rank, 2, rows_per_expert=128)
        shard = expert_shard(experts.mlp.w1)
        assert shard is not None and (shard.first_row, shard.local_rows, shard.global_rows) == (
            256 * rank,
            256,
            512,
        )
        slices.append(experts.mlp.w1.detach())
        assert torch.equal(whole.narrow(0, shard.first_row, shard.local_rows), slices[-1])
    assert torch.equal(torch.cat(slices), whole)
    with pytest.raises(ValueError, match="leading dimension 512, not the number of experts 4"):
        _slice_stacked(copy.deepcopy(info.experts), names, 4, 0, 2)


def test_experts_fed_rows_the_router_weighted_are_found_and_checked() -> None:
    """Llama 4 weighs each token by its routing score before the experts (``experts(routed_in)``): found as
    ``prescaled``, the router's logits its second output. The check refuses experts that map a zero row to
    something else (a bias: the unselected rows the parallel forward skips would not be zero) and a router
    whose scores are not zero outside the top-k of its logits."""
    from transformers import AutoModelForCausalLM

    from lightning_parallel.experts.prescaled import check_prescaled_experts
    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama4_text"))
    blocks = find_moe_blocks(model)
    assert blocks and {(b.kind, b.num_experts, b.router_outputs) for b in blocks} == {
        ("prescaled", 4, (1, 0))
    }
    info = blocks[0]
    check_prescaled_experts(info)
    experts = info.experts
    original = experts.forward
    experts.forward = lambda rows: original(rows) + 0.1  # a bias
    with pytest.raises(ValueError, match="map a zero row to something else"):
        check_prescaled_experts(info)
    experts.forward = original
    router_forward = info.router.forward
    info.router.forward = lambda x: (
        torch.sigmoid(router_forward(x)[1]),
        router_forward(x)[1],
    )  # dense scores
    with pytest.raises(ValueError, match="not zero outside the top-k"):
        check_prescaled_experts(info)


def test_the_aux_loss_reads_the_logits_a_router_returns_second() -> None:
    """Llama 4's router returns (scores, logits): the load-balancing loss is over the logits; read from the
    scores (the negative control) it is another loss."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama4_text"))
    blocks = find_moe_blocks(model)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for b in blocks:
        b.router.register_forward_hook(lambda m, a, out: seen.append((out[0].detach(), out[1].detach())))
    collector = AuxLossCollector(model, coef=1.0)
    collector.reset()
    model.train()
    model(torch.randint(0, 128, (2, 8)))
    added = collector.add_to_loss(torch.zeros(())).detach()
    top_k = blocks[0].top_k
    assert len(seen) == len(blocks) and top_k is not None
    expected = sum(_hf_aux(logits, 4, top_k) for _, logits in seen) / top_k
    torch.testing.assert_close(added, expected.float(), rtol=1e-5, atol=1e-6)
    from_scores = sum(_hf_aux(scores.nan_to_num(neginf=-1e4), 4, top_k) for scores, _ in seen) / top_k
    assert not torch.allclose(
        added, from_scores.float(), rtol=1e-3
    )  # a negative control: it must differ by more than rounding, so the tolerance is loose on purpose


def test_expert_linears_on_rows_grouped_by_expert_are_found_and_checked() -> None:
    """JetMoE calls each expert linear as ``linear(rows, rows_per_expert)``, in its MLP and in its mixture of
    attention heads: both blocks found as ``grouped_linear`` with their two linears; the check refuses a
    linear whose rows mix experts, and a router read at the wrong outputs (the negative controls)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from lightning_parallel.experts.grouped_linear import check_grouped_linears
    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("jetmoe"))
    blocks = find_moe_blocks(model)
    assert {(b.name.split(".")[-1], b.kind, b.grouped_names, b.router_outputs) for b in blocks} == {
        ("mlp", "grouped_linear", ("input_linear", "output_linear"), (4, 2)),
        ("experts", "grouped_linear", ("input_linear", "output_linear"), (4, 2)),
    }
    info = blocks[0]
    check_grouped_linears(info)
    with pytest.raises(ValueError, match="does not return"):
        check_grouped_linears(dataclasses.replace(info, router_outputs=(2, 4)))
    linear = info.block.input_linear
    original = linear.forward
    linear.forward = lambda rows, sizes: (
        original(rows, sizes) + rows.mean(0, keepdim=True).sum()
    )  # rows mixed
    with pytest.raises(ValueError, match="depend on other experts' rows"):
        check_grouped_linears(info)


@pytest.mark.parametrize("family", ["jetmoe", "dbrx", "llama4_text"])
def test_blocks_are_found_again_after_their_experts_are_sliced(family: str) -> None:
    """The strategy looks for the MoE blocks again once expert parallelism has sliced them (the load-balancing
    loss, the planner): each is found with its global expert count and rows per expert, as before slicing."""
    from transformers import AutoModelForCausalLM

    from lightning_parallel.experts.parallel import _slice_stacked
    from tests.models.tiny_configs import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(family))
    before = [(b.name, b.kind, b.num_experts, b.rows_per_expert) for b in find_moe_blocks(model)]
    for info in find_moe_blocks(model):
        for name in info.grouped_names or (info.experts_name,):
            owner = getattr(info.block, name)
            names = [n for n, p in owner.named_parameters() if p.dim() >= 2]
            _slice_stacked(owner, names, info.num_experts, 0, 2, info.rows_per_expert)
    after = [(b.name, b.kind, b.num_experts, b.rows_per_expert) for b in find_moe_blocks(model)]
    assert before and after == before


def test_dense_modules_with_a_gate_are_not_taken_for_experts() -> None:
    """A gate beside an attention called with (x, mask, positions), a convolution, or a bilinear map: none is a
    set of experts, whatever sizes coincide (each was taken for one by a looser rule)."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.zeros(16, 16))
            self.k = nn.Parameter(torch.zeros(16, 16))

        def forward(self, x, mask, positions):  # noqa: ANN001, ANN201
            return x

    for gate, other in ((nn.Linear(16, 2), Attention()), (nn.Linear(16, 8), nn.Conv1d(8, 8, 3)),
                        (nn.Linear(16, 4), nn.Bilinear(8, 8, 4))):  # fmt: skip
        block = nn.Module()
        block.gate, block.attn = gate, other
        assert find_moe_blocks(block) == []
