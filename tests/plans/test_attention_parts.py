"""Parts of an attention the planner reads by shape, where a coincidence of sizes misleads a rule that looks
at sizes alone: which projection makes which latent (equal q and kv latent widths), and a child's buffer
whose length happens to equal the head count (a rotary embedding's frequencies). No processes."""

from __future__ import annotations

import torch
from torch import nn

from lightning_parallel.plans.attention import helper_styles, latent_makers, own_tensor_styles
from lightning_parallel.tensor_parallel.param_styles import LocalParameters


def test_equal_latent_widths_are_paired_by_name() -> None:
    """Dots3's q and kv latents are both 1024 wide: ``kv_b_proj`` reads what ``kv_a_proj_with_mqa`` makes (the
    latent plus the rotary key), not the narrower ``q_a_proj``; DeepSeek's unequal widths pair as before."""
    equal = _latent_attention(q_latent=32)
    assert latent_makers(equal, HIDDEN) == {"q_b_proj": "q_a_proj", "kv_b_proj": "kv_a_proj_with_mqa"}
    # without names to go by (the negative control of the name rule), the narrowest maker takes both readers
    anonymous = [(name, m) for name, (_, m) in zip(("make1", "read1", "make2", "read2"), equal, strict=True)]
    assert set(latent_makers(anonymous, HIDDEN).values()) == {"make1"}
    deepseek = _latent_attention(q_latent=48)
    assert latent_makers(deepseek, HIDDEN) == {"q_b_proj": "q_a_proj", "kv_b_proj": "kv_a_proj_with_mqa"}


HIDDEN = 64


def _latent_attention(q_latent: int) -> list[tuple[str, nn.Module]]:
    """Multi-head latent attention's projections: a 32-wide kv latent made with an 8-wide rotary key."""
    return [
        ("q_a_proj", nn.Linear(HIDDEN, q_latent)),
        ("q_b_proj", nn.Linear(q_latent, 64)),
        ("kv_a_proj_with_mqa", nn.Linear(HIDDEN, 40)),
        ("kv_b_proj", nn.Linear(32, 128)),
    ]


class _Rotary(nn.Module):
    def __init__(self, frequencies: int) -> None:
        super().__init__()
        self.inv_freq = nn.Buffer(torch.arange(float(frequencies)), persistent=False)


class _Attention(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.rotary_emb = _Rotary(heads)  # 4 frequencies, 4 heads: RecurrentGemma's tiny config
        self.decay = nn.Buffer(
            torch.arange(float(heads)).view(heads, 1, 1)
        )  # MiniMax-like, the attention's own


def test_a_child_s_buffers_stay_whole_even_when_as_long_as_the_heads() -> None:
    """RecurrentGemma's rotary child holds 4 frequencies and the attention 4 heads: the frequencies stay whole
    (cut, each rank's rotary angles were wrong); a per-head buffer of the attention itself is still cut."""
    attention = _Attention(4)
    assert helper_styles(attention, "attn", {4: "heads"}, set()) == {}
    own = own_tensor_styles(attention, "attn", {4: "heads"})["attn"]
    assert isinstance(own, LocalParameters) and own.dims == {"decay": 0}
    # the negative control: the child's buffers read as per-head tensors
    cut = own_tensor_styles(attention.rotary_emb, "attn.rotary_emb", {4: "heads"})["attn.rotary_emb"]
    assert cut.dims == {"inv_freq": 0}


class _Wrapper(nn.Module):
    """Moshi's ``MoshiLinear``: one projection inside, nothing else."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out, bias=False)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.linear(x)


class _WrappedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_Wrapper(16, 16) for _ in range(4))


class _Gated(nn.Module):
    """CPM-Ant's ``w_in``: the gate and up projections beside an activation, the exit one level up."""

    def __init__(self) -> None:
        super().__init__()
        self.w_0, self.w_1, self.act = nn.Linear(16, 32), nn.Linear(16, 32), nn.GELU()


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in, self.dropout, self.w_out = _Gated(), nn.Dropout(0.0), nn.Linear(32, 16)


def test_projections_inside_wrappers_and_a_gated_pair_beside_the_exit_are_found() -> None:
    """Projections wrapped one each in a module of their own are the attention's (Moshi: was left whole, 43%
    of the stack sharded); a gate|up pair in a child beside the exit is the MLP's entries, and that child is
    no container of its own (CPM-Ant: 40%). The negative control: a child with a parameter of its own beside
    its projection is not a wrapper."""
    from lightning_parallel.plans.detect import containers_in

    block = nn.Module()
    block.attn, block.ffn = _WrappedAttention(), _FeedForward()
    found = {c.name: [n for n, _ in c.projections] for c in containers_in(block)}
    assert found == {
        "attn": ["q_proj.linear", "k_proj.linear", "v_proj.linear", "o_proj.linear"],
        "ffn": ["w_in.w_0", "w_in.w_1", "w_out"],
    }
    block.attn.q_proj.scale = nn.Parameter(torch.arange(1.0))
    assert [n for n, _ in containers_in(block)[0].projections] == [
        "k_proj.linear",
        "v_proj.linear",
        "o_proj.linear",
    ]


def test_projections_of_the_block_itself_that_narrow_the_hidden_state_stay_whole() -> None:
    """Gemma 4's per-layer input gate (hidden -> 16, times a model-level input, -> hidden) sits on the decoder
    layer itself: left whole with the reason in the plan (sharded, each rank's 8-wide gate met the 16-wide
    input); OPT's fc1 and fc2, also the block's own, widen it: still an MLP (the negative control)."""
    from transformers import AutoModelForCausalLM

    from lightning_parallel.plans.auto import auto_plan
    from tests.models.tiny_configs import tiny_config

    gemma = AutoModelForCausalLM.from_config(tiny_config("gemma4_text"))
    plan = auto_plan(gemma, tensor_parallel=2, sequence_parallel=False)
    blocks = set(plan.block_names)
    assert not any(c.name in blocks for c in plan.containers)
    assert any("narrow its 64-wide hidden state to 16" in note for note in plan.notes)
    opt = AutoModelForCausalLM.from_config(tiny_config("opt"))
    plan = auto_plan(opt, tensor_parallel=2, sequence_parallel=False)
    assert any(c.name in set(plan.block_names) and c.kind == "mlp" for c in plan.containers)
