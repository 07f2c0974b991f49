"""16-bit casts kept once or not at all (``memory/casts.py``), in one process, against autocast's own copies.

Micro-batches run as GPipe runs them (every forward, then every backward) under one autocast region without
its weight cache (Lightning's), through the strategy's saved-tensor hooks. With the casts handled, what is
held for backward loses exactly one 16-bit copy of every matmul's weight per micro-batch, and for Llama
the copies of an input its q, k and v (gate and up) each made; at 2 and 4 micro-batches. Gradients and
losses are bitwise equal to autocast's. Negative controls: the saver switched off keeps the copies (the
"before" of the issue); a weight changed in place before its backward is refused, not silently used.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.memory.casts import CastSaver, cast_parameter
from lightning_parallel.memory.counting import SavedTensorCounter
from lightning_parallel.memory.saved_tensors import ActivationSaver, saved_tensors_context
from tests.models.families import build

BATCH, SEQ, WIDTH = 2, 32, 64


def _run(family: str, casts: CastSaver, micro_batches: int, saver: ActivationSaver | None = None) -> dict:
    torch.manual_seed(0)
    module = build(family)
    model = module.model
    x = torch.randint(0, 128, (micro_batches, BATCH, SEQ))
    y = torch.randint(0, 128, (micro_batches, BATCH, SEQ))
    counter = SavedTensorCounter.for_module(model)
    losses = []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning enters it
    with saved_tensors_context(saver, counter, casts), autocast:
        for m in range(micro_batches):
            out = model(input_ids=x[m]) if family.startswith("hf_") else model(x[m])
            logits = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[m].reshape(-1)))
    for loss in losses:
        (loss / micro_batches).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": [loss.item() for loss in losses], "grads": grads, "bytes": counter.bytes, "model": model,
            "stats": casts.stats}  # fmt: skip


def _matmul_weight_bytes(model: nn.Module) -> int:
    """One 16-bit copy of every weight a linear (or GPT-2's Conv1D) multiplies by, once per module."""
    seen, total = set(), 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and not isinstance(module, nn.Embedding):
            if id(module) not in seen:
                seen.add(id(module))
                total += weight.numel() * 2
    return total


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("family", ["recipe_gpt", "nanogpt", "hf_gpt2", "hf_llama"])
def test_weight_copies_are_not_kept_and_gradients_are_bitwise_equal(family: str, micro_batches: int) -> None:
    kept = _run(family, CastSaver(weights=False, activations=False), micro_batches)
    handled = _run(family, CastSaver(), micro_batches)
    assert handled["losses"] == kept["losses"]
    assert handled["grads"].keys() == kept["grads"].keys()
    assert all(torch.equal(handled["grads"][n], kept["grads"][n]) for n in kept["grads"])
    weights = _matmul_weight_bytes(handled["model"])
    # Llama: q|k|v each cast the attention's input, gate|up the MLP's; two and one of those copies are shared.
    layers = 2
    shared = micro_batches * layers * 3 * BATCH * SEQ * WIDTH * 2 if family == "hf_llama" else 0
    assert kept["bytes"].total - handled["bytes"].total == micro_batches * weights + shared
    assert (
        kept["bytes"].peak - handled["bytes"].peak == micro_batches * weights + shared
    )  # GPipe: all at once
    assert handled["stats"].weight_bytes == micro_batches * weights
    assert handled["stats"].shared_bytes == shared
    assert kept["stats"].weight_casts == kept["stats"].shared_casts == 0  # the negative control kept them all


def test_with_activation_offload_weight_copies_are_not_offloaded_either() -> None:
    """Under offload an input's copies are not shared (the first leaves the device before the next is made:
    each is offloaded as before); the weights' are still not kept, so not moved to the host and back."""
    plain = _run("hf_llama", CastSaver(weights=False, activations=False), 2)
    module = build("hf_llama").model
    saver = ActivationSaver(offload=True, parameters=list(module.parameters()))
    offloaded = _run("hf_llama", CastSaver(), 2, saver=saver)
    assert offloaded["losses"] == plain["losses"]
    assert all(torch.equal(offloaded["grads"][n], plain["grads"][n]) for n in plain["grads"])
    assert offloaded["stats"].weight_casts > 0 and offloaded["stats"].shared_casts == 0


def test_a_weight_changed_before_its_backward_is_refused() -> None:
    linear = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with (
        saved_tensors_context(None, None, CastSaver()),
        torch.autocast("cpu", torch.bfloat16, cache_enabled=False),
    ):
        loss = linear(x).float().sum()
    with torch.no_grad():
        linear.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between its use in forward and its backward"):
        loss.backward()


def test_only_casts_of_parameters_count_as_weight_casts() -> None:
    linear = nn.Linear(8, 8)
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        weight_copy = linear.weight.to(torch.bfloat16).t()  # what a linear saves
        activation = torch.randn(4, 8, requires_grad=True).to(torch.bfloat16)
    assert cast_parameter(weight_copy) is linear.weight
    assert cast_parameter(activation) is None
    assert cast_parameter(linear.weight) is None
