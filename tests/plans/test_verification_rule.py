"""The plan verification's gradient rule: a gradient that is zero in exact arithmetic is not a false refusal.

OPT's key-projection bias is the example: softmax ignores a shift shared by every key, so that
bias's gradient is rounding noise in both the sharded and the unsharded run, and their relative
error is about 1 (a right layout was refused: ``tests/distributed/test_parity_hybrid.py`` now
trains OPT under tp=2). Such a gradient is found by the block's float64 gradients and judged
against the block's largest; every other gradient keeps the 1e-5 relative rule, widened by twice the
unsharded fp32 gradient's own distance from float64 (Qwen 3.5's gated linear attention loses 1e-5 in fp32
over its recurrence, and a right layout was refused for it).
"""

from __future__ import annotations

import torch

from lightning_parallel.tensor_parallel.verify import TOLERANCE, exact_gradients, gradient_problem
from tests.models.hf import HFOPTModule


def _opt_layer_and_inputs() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = HFOPTModule().model
    layer = model.model.decoder.layers[0]
    hidden = torch.randn(2, 16, 64)
    mask = torch.full((16, 16), float("-inf")).triu(1)[None, None].expand(2, 1, 16, 16)
    return layer, ((hidden,), {"attention_mask": mask})


def test_only_the_key_bias_gradient_is_zero_in_exact_arithmetic() -> None:
    layer, inputs = _opt_layer_and_inputs()
    exact = {name: float(grad.norm()) for name, grad in exact_gradients(layer, inputs).items()}
    largest = max(exact.values())
    zero = sorted(name for name, norm in exact.items() if norm <= 1e-9 * largest)
    assert zero == ["self_attn.k_proj.bias"], {n: exact[n] / largest for n in zero}
    assert exact["self_attn.q_proj.bias"] > 1e-6 * largest  # a real gradient


def test_the_rule_passes_noise_on_a_zero_gradient_and_fails_a_wrong_one() -> None:
    exact = {"k.bias": torch.full((4,), 5e-21), "q.bias": torch.full((4,), 0.25), "w": torch.full((4,), 5.0)}
    noise = torch.full((4,), 1e-8)
    # Noise on a zero gradient: relative error 1, passes (the false refusal, fixed).
    assert gradient_problem("k.bias", noise, -noise, exact) is None
    # Negative controls: a real difference on that gradient, and the 1e-5 relative rule elsewhere.
    wrong = torch.full((4,), 1e-3)
    assert "zero in exact arithmetic" in (gradient_problem("k.bias", wrong, noise, exact) or "")
    want = torch.full((4,), 0.25)
    assert gradient_problem("q.bias", want * (1 + 0.5 * TOLERANCE), want, exact) is None
    assert "relative error" in (gradient_problem("q.bias", want * (1 + 4 * TOLERANCE), want, exact) or "")


def test_without_a_float64_run_the_fp32_gradients_tell_a_zero() -> None:
    """XGLM's attention overflows in float64 (no exact gradients): its key bias's rounding noise is told apart by
    the unsharded fp32 gradients of the block, at fp32's rounding."""
    fp32 = {"k.bias": torch.full((4,), 2e-8), "q.bias": torch.full((4,), 0.25), "w": torch.full((4,), 5.0)}
    noise = torch.full((4,), 1e-8)
    assert gradient_problem("k.bias", noise, fp32["k.bias"], {}, fp32=fp32) is None
    # Negative controls: without the fp32 gradients the relative rule refuses the noise (what XGLM hit), and a
    # real difference on that gradient, or the relative rule on a real gradient, still fails.
    assert "relative error" in (gradient_problem("k.bias", noise, fp32["k.bias"], {}) or "")
    assert "zero in exact arithmetic" in (
        gradient_problem("k.bias", torch.full((4,), 1e-3), fp32["k.bias"], {}, fp32=fp32) or ""
    )
    want = fp32["q.bias"]
    assert "relative error" in (
        gradient_problem("q.bias", want * (1 + 4 * TOLERANCE), want, {}, fp32=fp32) or ""
    )


def test_a_gradient_fp32_itself_misses_by_more_than_the_rule_gets_that_much_room() -> None:
    want, exact = torch.full((4,), 0.25), {"a_log": torch.full((4,), 0.25 * (1 + 3 * TOLERANCE))}
    # the fp32 reference is 3e-5 from float64: a sharded gradient 5e-5 from it is within its rounding
    assert gradient_problem("a_log", want * (1 + 5 * TOLERANCE), want, exact) is None
    # negative control: a real difference is not
    assert "fp32's own 3.0e-05" in (gradient_problem("a_log", want * (1 + 10 * TOLERANCE), want, exact) or "")


def _moe_layer_and_inputs() -> tuple[torch.nn.Module, tuple]:
    from transformers import AutoModelForCausalLM

    from tests.models.zoo import zoo_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo_config("qwen3_moe", 128, 32, 1)).model
    hidden = torch.randn(2, 16, 64)
    positions = model.rotary_emb(hidden, torch.arange(16)[None].expand(2, 16))
    return model.layers[0], ((hidden,), {"position_embeddings": positions, "attention_mask": None})


def test_experts_that_run_grouped_mm_get_float64_gradients_by_their_loop(monkeypatch: object) -> None:
    """grouped_mm has no float64 on a CPU: the float64 pass runs the experts' per-expert loop (the same sums),
    so an MoE block's gradients get the float64 room too (a right Qwen 3.5 MoE layout was refused without)."""
    from lightning_parallel.tensor_parallel import verify

    layer, inputs = _moe_layer_and_inputs()
    assert layer.mlp.experts.config._experts_implementation == "grouped_mm"
    exact = exact_gradients(layer, inputs)
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"} <= set(exact)
    assert all(g.dtype == torch.float64 for g in exact.values())
    assert layer.mlp.experts.config._experts_implementation == "grouped_mm"  # the user's block is untouched
    # negative control: without the switch, no float64 gradients at all
    monkeypatch.setattr(verify, "_eager_experts", lambda module: False)  # type: ignore[attr-defined]
    assert exact_gradients(layer, inputs) == {}


def test_the_refusal_lists_a_few_ways_and_differences_each() -> None:
    """A block tried 16 ways with 20 differences each is refused in a message of four ways, three differences
    each (it was every way with every gradient, pages of log). Negative control: two ways of two differences
    are shown whole."""
    from lightning_parallel.tensor_parallel.verify import _summary

    failures = [f"way {w}: " + "; ".join(f"gradient of `p{g}` differs" for g in range(20)) for w in range(16)]
    summary = _summary(failures)
    assert summary.count(" | ") == 4 and summary.endswith("| and 12 more ways")
    assert summary.count("; and 17 more") == 4 and "`p3`" not in summary
    few = ["way a: output differs; input gradient differs", "way b: RuntimeError: shapes"]
    assert _summary(few) == " | ".join(few)
