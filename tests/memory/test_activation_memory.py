"""Activation memory held for backward, counted exactly, for every saver; gradients they leave.

One process, no Trainer (the strategy wiring is tested in ``test_strategy_memory.py`` and the
layouts in ``tests/distributed/test_parity_memory.py``): the recipe GPT at test size, one
forward and backward per option, counted through ``saved_tensors_hooks``
(:class:`~lightning_parallel.memory.SavedTensorCounter`).

Expected bytes are computed from shapes. With B=2 sequences of T=32 tokens, width C=64,
vocabulary V=128 and fp32 activations, what the recipe's step saves *outside* the blocks is:
token ids (B T int64) for the embedding, the positions (T int64), the final LayerNorm's input
and output (2 B T C fp32) and its mean and 1/std (2 B T fp32), the log-softmax of the logits
(B T V fp32), the targets (B T int64) and the loss's total weight (one fp32). Full
checkpointing adds only each block's input (B T C fp32) per block.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lightning_parallel.config.arguments import checkpointing as checkpointing_config
from lightning_parallel.memory import (
    ActivationBytes,
    ActivationSaver,
    CheckpointingConfig,
    SavedTensorCounter,
    apply_activation_checkpointing,
    counting,
    is_checkpointed,
)
from lightning_parallel.plans.detect import find_block_stack

B, T, C, V, HEADS = 2, 32, 64, 128, 4
F32, I64 = 4, 8


def gpt(n_layer: int = 2) -> torch.nn.Module:
    from recipes.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=HEADS, n_embd=C))


def block_names(model: torch.nn.Module) -> list[str]:
    stack = find_block_stack(model)
    assert stack is not None
    return [f"{stack.name}.{i}" for i in range(len(stack.blocks))]


def outside_blocks_bytes() -> int:
    return B * T * I64 + T * I64 + 2 * B * T * C * F32 + 2 * B * T * F32 + B * T * V * F32 + B * T * I64 + F32


def step(
    model: torch.nn.Module, checkpointing: CheckpointingConfig | None = None, **saver: object
) -> tuple[ActivationBytes, float, dict[str, torch.Tensor]]:
    """One forward+backward: the bytes held for backward, the loss, the gradients."""
    if checkpointing is not None:
        apply_activation_checkpointing(model, checkpointing, block_names(model))
    counter = SavedTensorCounter.for_module(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(V, (B, T), generator=generator)
    y = torch.randint(V, (B, T), generator=generator)
    if saver:
        blocks = list(find_block_stack(model).blocks)
        context = ActivationSaver(parameters=list(model.parameters()), blocks=blocks, **saver).context(
            counter
        )
    else:
        context = counting(counter)
    with context:
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, V), y.view(-1))
    loss.backward()
    return counter.bytes, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("n_layer", [2, 3])
def test_full_checkpointing_keeps_only_the_block_inputs(n_layer: int) -> None:
    held, _, _ = step(gpt(n_layer), checkpointing_config("full", None))
    assert held.total == outside_blocks_bytes() + n_layer * B * T * C * F32
    assert held.recompute_kept == 0 and held.recompute_inputs == 0  # inputs are positional: saved tensors


def test_every_option_against_the_baseline() -> None:
    base = gpt()
    options = {
        "none": {},
        "selective (ops)": {"checkpointing": checkpointing_config("selective", "ops")},
        "selective (alternate matmuls)": {
            "checkpointing": checkpointing_config("selective", "ops_alternate_matmuls")
        },
        "selective (every 2nd block)": {"checkpointing": checkpointing_config("selective", 2)},
        "full": {"checkpointing": checkpointing_config("full", None)},
        "offload": {"offload": True},
        "bf16 compression": {"compression": "bf16"},
        "fp8 compression": {"compression": "fp8"},
        "full + offload": {"checkpointing": checkpointing_config("full", None), "offload": True},
    }
    held = {name: step(copy.deepcopy(base), **kwargs)[0] for name, kwargs in options.items()}
    baseline = held["none"].total
    print(f"\nactivation bytes held for backward, recipe GPT B={B} T={T} C={C} 2 blocks (fp32):")
    for name, counted in held.items():
        print(f"  {name:28s} on device {counted.on_device:8d} ({counted.on_device / baseline:5.1%})"
              f"  total {counted.total:8d}  offloaded {counted.offloaded:8d}")  # fmt: skip

    per_block = (baseline - outside_blocks_bytes()) // 2
    assert baseline == outside_blocks_bytes() + 2 * per_block
    # Selective: the inputs plus the kept matmul/attention outputs: qkv (3C), attention out (C)
    # and its log-sum-exp (HEADS per token), projection (C), fc (4C), mlp projection (C).
    selective = held["selective (ops)"]
    assert selective.recompute_kept == 2 * (10 * B * T * C + B * HEADS * T) * F32
    assert selective.total == held["full"].total + selective.recompute_kept
    # Every second projection matmul recomputed: of qkv, proj, fc and the MLP projection (the block's order),
    # proj and the MLP projection (C each) are not kept; the attention kernel's outputs still are.
    alternate = held["selective (alternate matmuls)"]
    assert alternate.recompute_kept == 2 * (8 * B * T * C + B * HEADS * T) * F32
    assert alternate.total == held["full"].total + alternate.recompute_kept
    assert held["selective (every 2nd block)"].total == outside_blocks_bytes() + B * T * C * F32 + per_block
    # Offload keeps the last block and what follows it (backward needs them first); the rest goes to the host.
    after_blocks = outside_blocks_bytes() - (B * T + T) * I64  # all but the embeddings' ids and positions
    assert held["offload"].on_device == per_block + after_blocks
    assert held["offload"].offloaded == baseline - held["offload"].on_device
    assert held["full + offload"].on_device == B * T * C * F32 + after_blocks  # the last block's input
    assert held["full + offload"].total == held["full"].total
    integers = (B * T + T + B * T) * I64  # ids, positions, targets: never compressed
    assert held["bf16 compression"].total == integers + (baseline - integers) // 2
    scales = F32 * held["fp8 compression"].tensors  # at most one fp32 scale per saved storage
    assert held["fp8 compression"].total <= integers + (baseline - integers) // 4 + scales


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("full", {"checkpointing": CheckpointingConfig("full")}),
        ("selective", {"checkpointing": CheckpointingConfig("selective", ops=True)}),
        ("alternate", {"checkpointing": CheckpointingConfig("selective", ops=True, alternate_matmuls=True)}),
        ("every 2nd", {"checkpointing": CheckpointingConfig("selective", every=2)}),
        ("patterns", {"checkpointing": CheckpointingConfig("selective", patterns=("transformer.h.*.mlp",))}),
        ("offload", {"offload": True}),
        ("offload + full", {"offload": True, "checkpointing": CheckpointingConfig("full")}),
    ],
)
def test_recomputation_and_offload_leave_loss_and_gradients_bitwise_equal(name: str, options: dict) -> None:
    base = gpt()
    _, ref_loss, ref_grads = step(copy.deepcopy(base))
    _, loss, grads = step(copy.deepcopy(base), **options)
    assert loss == ref_loss
    for key, grad in grads.items():
        assert torch.equal(grad, ref_grads[key]), f"{name}: gradient of {key} differs"


# Relative error of every parameter's gradient after one step (measured on this model: bf16
# 5.0e-3, fp8 8.4e-2). bf16 rounds each saved element with relative error <= 2^-9; a gradient
# goes through several rounded factors (about 2^-9 each, adding up along the backward path),
# so the bound is 2^-6 (8 such factors in the worst case); fp8 e4m3 rounds with <= 2^-4, bound 2^-2.
GRADIENT_BOUND = {"bf16": 2**-6, "fp8": 2**-2}


@pytest.mark.parametrize("compression", ["bf16", "fp8"])
def test_compression_leaves_the_loss_exact_and_gradients_within_bound(compression: str) -> None:
    base = gpt()
    _, ref_loss, ref_grads = step(copy.deepcopy(base))
    _, loss, grads = step(copy.deepcopy(base), compression=compression)
    assert loss == ref_loss  # the forward pass never reads a compressed tensor
    worst = max(float((grads[k] - g).norm() / g.norm()) for k, g in ref_grads.items() if g.norm() > 0)
    print(
        f"\n{compression}: worst relative gradient error {worst:.2e} (bound {GRADIENT_BOUND[compression]:.2e})"
    )
    assert 0 < worst < GRADIENT_BOUND[compression]


def test_offload_prefetches_the_previous_block_during_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_parallel.memory import saved_tensors

    model = gpt(3)
    look_ahead: list[tuple[int, int, int]] = []
    restored_from_prefetch: list[bool] = []
    original_prefetch = saved_tensors.ActivationSaver._prefetch
    original_restore = saved_tensors._StoredStorage.restore

    def prefetch(
        self: saved_tensors.ActivationSaver, group: tuple[int, int, int] | None, device: torch.device
    ) -> None:
        if group is not None and group not in self._prefetched:
            look_ahead.append(group)
        original_prefetch(self, group, device)

    def restore(self: saved_tensors._StoredStorage, stream: object = None) -> torch.Tensor:
        if self._alive() is None:
            restored_from_prefetch.append(self.ready is not None)
        return original_restore(self, stream)

    monkeypatch.setattr(saved_tensors.ActivationSaver, "_prefetch", prefetch)
    monkeypatch.setattr(saved_tensors._StoredStorage, "restore", restore)
    step(model, offload=True)
    # Groups are (stage, forward, block position): position -1 before the first block, 0..2 from blocks 0..2 on
    # (the head and loss belong to block 2). The first activation unpacked from block i starts copying block
    # i - 1's back: the blocks come back in backward order, one ahead.
    assert look_ahead == [(0, 0, 1), (0, 0, 0), (0, 0, -1)]
    # The last block's group (with the head) stays on the device, and unpacking it starts block 1's
    # copy: nothing is copied back on demand, every offloaded storage came prefetched.
    assert restored_from_prefetch.count(False) == 0 and sum(restored_from_prefetch) >= 3 * 5


def test_checkpointing_keeps_parameter_names_and_state_dict_keys() -> None:
    model = gpt()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, CheckpointingConfig("full"), block_names(model))
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert all(is_checkpointed(block) for block in find_block_stack(model).blocks)
    # Applying twice does not wrap twice.
    assert apply_activation_checkpointing(model, CheckpointingConfig("full"), block_names(model)) == []


def test_patterns_that_match_nothing_are_refused_with_an_example() -> None:
    model = gpt()
    config = CheckpointingConfig("selective", patterns=("model.blocks.*",))
    with pytest.raises(
        ValueError, match=r"pattern\(s\) \['model.blocks.\*'\] match no module of GPT.*'transformer.h.0'"
    ):
        apply_activation_checkpointing(model, config, block_names(model))


@pytest.mark.parametrize("family", ["nanogpt", "hf_llama"])
def test_full_checkpointing_on_other_families_is_bitwise_equal(family: str) -> None:
    from tests.models.families import build

    torch.manual_seed(0)
    x = torch.randint(V, (B, T))
    results = []
    for checkpointed in (False, True):
        module = build(family)
        if checkpointed:
            stack = find_block_stack(module)
            apply_activation_checkpointing(
                module, CheckpointingConfig("full"), [f"{stack.name}.{i}" for i in range(len(stack.blocks))]
            )
        counter = SavedTensorCounter.for_module(module)
        with counting(counter):
            loss = module.training_step((x, x.roll(-1, 1)), 0)
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in module.parameters()], counter.bytes))
    (ref_loss, ref_grads, ref_bytes), (loss, grads, held) = results
    assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert held.total < ref_bytes.total / 2


def test_weights_cast_by_autocast_are_left_alone() -> None:
    """Under autocast a matmul saves the low-precision copy of its weight: no activation, never offloaded
    or compressed (it was: every weight to the host and back each step, fp8 rounding the weights).
    Negative control: the casts are there to be seen (autocast really cast weights)."""
    from lightning_parallel.memory import saved_tensors

    model = gpt(2)
    saver = ActivationSaver(offload=True, compression="fp8", parameters=list(model.parameters()),
                            blocks=list(find_block_stack(model).blocks))  # fmt: skip
    casts, stored_casts = [], []
    original = saver._pack

    def pack(tensor: torch.Tensor) -> object:
        packed = original(tensor)
        if saved_tensors.is_parameter_cast(tensor):
            casts.append(tensor)
            # kept as it is (detached, the same storage), not offloaded or compressed
            kept = isinstance(packed, torch.Tensor) and packed.data_ptr() == tensor.data_ptr()
            stored_casts.append(not kept)
        return packed

    saver._pack = pack  # type: ignore[method-assign]
    x = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16), saver.context():
        loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    assert len(casts) >= 2 * 4 and all(
        c.dtype == torch.bfloat16 for c in casts
    )  # each block's matmul weights
    assert not any(stored_casts)


def test_host_buffers_are_reused_across_steps() -> None:
    """Offloaded storages reuse the host buffers of the previous step (pinned allocations are slow on a GPU)."""
    model = gpt(3)
    saver = ActivationSaver(offload=True, parameters=list(model.parameters()),
                            blocks=list(find_block_stack(model).blocks))  # fmt: skip
    x = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))
    made = []
    for _ in range(3):
        with saver.context():
            loss = model(x).logsumexp(-1).mean()
        loss.backward()
        del loss
        made.append(saver.buffers.allocated)
    assert made[0] > 0 and made[2] == made[0], made


def test_offload_counts_the_weight_casts_it_leaves_alone() -> None:
    """Under autocast the bytes held for backward are the same counted with and without the offloading
    saver (the casts are held, not offloaded); only the activations move to the host."""
    x = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))
    counted = {}
    for name in ("counting", "offload"):
        model = gpt(2)
        counter = SavedTensorCounter.for_module(model)
        if name == "offload":
            blocks = list(find_block_stack(model).blocks)
            context = ActivationSaver(
                offload=True, parameters=list(model.parameters()), blocks=blocks
            ).context(counter)
        else:
            context = counting(counter)
        with torch.autocast("cpu", dtype=torch.bfloat16), context:
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        counted[name] = counter.bytes
    assert counted["offload"].saved == counted["counting"].saved > 0
    assert counted["offload"].stored == counted["counting"].stored
    assert 0 < counted["offload"].offloaded < counted["offload"].stored


def test_selective_policy_takes_torch_2_11_contexts() -> None:
    """torch 2.11's selective-checkpoint context has no ``op_output`` (the policy runs before the op, and
    again with ``is_recompute=True`` while recomputing): the same decisions, nothing counted twice."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from lightning_parallel.memory.checkpointing import _selective_policy

    mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    keep, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    out = torch.ones(4, 4)
    counter = SavedTensorCounter()
    with counting(counter):
        assert _selective_policy(SimpleNamespace(is_recompute=False), mm) == keep  # 2.11, before the op
        assert _selective_policy(SimpleNamespace(is_recompute=True), mm) == keep  # 2.11, recomputing
        assert _selective_policy(SimpleNamespace(is_recompute=False), relu) == recompute
        assert counter.bytes.recompute_kept == 0
        assert _selective_policy(SimpleNamespace(is_recompute=True, op_output=out), mm) == keep
        assert counter.bytes.recompute_kept == 0
        assert _selective_policy(SimpleNamespace(is_recompute=False, op_output=out), mm) == keep  # 2.13
        assert counter.bytes.recompute_kept == out.numel() * F32


def test_selective_kept_outputs_counted_without_op_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's path on any torch: the policy never sees an output, a dispatch mode counts what it keeps;
    the same bytes, and the same gradients, as where the policy is handed each kept output."""
    from types import SimpleNamespace

    from lightning_parallel.memory import checkpointing

    config = checkpointing_config("selective", "ops")
    want, want_loss, want_grads = step(gpt(), config)
    policy = checkpointing._selective_policy

    def before_the_op(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        return policy(SimpleNamespace(is_recompute=getattr(ctx, "is_recompute", False)), op, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "_selective_policy", before_the_op)
    monkeypatch.setattr(checkpointing, "selective_policy_sees_output", lambda: False)
    held, loss, grads = step(gpt(), config)
    assert held.recompute_kept == want.recompute_kept == 2 * (10 * B * T * C + B * HEADS * T) * F32
    assert held == want and loss == want_loss
    assert all(torch.equal(grads[name], grad) for name, grad in want_grads.items())


def test_alternate_matmuls_recompute_every_second_projection() -> None:
    """What backward runs again: under "ops" no matrix product, under "ops_alternate_matmuls" the attention's
    exit projection of each block, once (the MLP projection, 4th, is not kept either, but nothing in backward
    reads its output: torch's recomputation stops before it); the gradients stay bitwise equal (above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecomputedMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if torch.is_grad_enabled() and torch._C._current_autograd_node() is not None:
                self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
            return func(*args, **(kwargs or {}))

    counts = {}
    for policy in ("ops", "ops_alternate_matmuls"):
        model = gpt()
        apply_activation_checkpointing(model, checkpointing_config("selective", policy), block_names(model))
        x = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))
        with RecomputedMatmuls() as mode:
            model(x).sum().backward()
        counts[policy] = mode.count
    assert counts == {"ops": 0, "ops_alternate_matmuls": 2}  # 2 blocks x the attention's exit projection


@pytest.mark.parametrize("sees_output", [False, True], ids=["torch 2.11", "torch 2.13"])
def test_alternate_matmuls_policy_counts_each_pass_apart(
    monkeypatch: pytest.MonkeyPatch, sees_output: bool
) -> None:
    """2.11 asks the policy before each op (no ``op_output``), 2.13 after it (with it); both ask again while
    recomputing. The passes count apart, and a region recomputed twice (zero-bubble schedules) starts again."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from lightning_parallel.memory import checkpointing

    monkeypatch.setattr(checkpointing, "selective_policy_sees_output", lambda: sees_output)
    mm, keep, recompute = (
        torch.ops.aten.mm.default,
        CheckpointPolicy.MUST_SAVE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    )
    output = {"op_output": torch.ones(2, 2)} if sees_output else {}
    policy = checkpointing._AlternateMatmuls()
    forward = [policy(SimpleNamespace(is_recompute=False, **output), mm) for _ in range(4)]
    again = [policy(SimpleNamespace(is_recompute=True), mm) for _ in range(8)]
    assert forward == [keep, recompute, keep, recompute] and again == forward + forward


class _SavesAnEmptyTensor(torch.autograd.Function):
    """Saves its input and an empty CPU tensor beside it, as torch 2.11's checkpoint saves one per region."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, torch.empty((0,), requires_grad=True))
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, empty = ctx.saved_tensors
        assert empty.numel() == 0
        return grad * 2


def test_an_empty_saved_tensor_is_kept_and_joins_no_offload_group() -> None:
    """Every empty CPU tensor has the storage key ("cpu", 0): stored, they would share one entry and one block
    group, fetched back at the start of backward on the compute stream (torch 2.11's checkpoint, a GPU run)."""
    model = gpt(3)
    blocks = list(find_block_stack(model).blocks)
    saver = ActivationSaver(offload=True, parameters=list(model.parameters()), blocks=blocks)
    x = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))
    original = blocks[0].forward
    blocks[0].forward = lambda h, *a, **k: original(_SavesAnEmptyTensor.apply(h), *a, **k)  # type: ignore[method-assign]
    with saver.context():
        loss = model(x).logsumexp(-1).mean()
    grouped = [stored() for members in saver._groups.values() for stored in members]
    assert grouped and all(s is None or s.numel > 0 for s in grouped)  # offload engaged, nothing empty in it
    loss.backward()
