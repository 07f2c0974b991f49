"""The stage surgery, checked in one process: chaining the cut stages by hand equals the whole model.

Each stage is a deep copy of the model cut for one pipeline rank. Running the user's own
``training_step`` on stage 0 stops at its last block (``StageExit``); the next stage runs the
same step from its first line with that hidden state injected at its first block; the last
stage returns the loss. Loss and every gradient must equal the uncut model's, for a model with
a tied embedding/head (nanoGPT), one without (Llama) and the interleaved placement where one
rank holds two non-adjacent stages.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lightning_parallel.config.arguments import resolve_schedule
from lightning_parallel.pipeline.discover import PipelineSetupError, discover
from lightning_parallel.pipeline.schedules import stage_owner, stages_of_rank
from lightning_parallel.pipeline.setup import StageSplit, find_block_names, plan_stages
from lightning_parallel.pipeline.split import balanced_boundaries, stage_ranges
from lightning_parallel.pipeline.stages import (
    SkippedBlock,
    StageExit,
    StageLayout,
    StageRuntime,
    cut_into_stages,
)
from tests.models.families import FAMILIES


def _quiet(module: Any) -> Any:
    module.log = lambda *args, **kwargs: None
    return module


def _batch(vocab: int = 128, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _layout(model: Any, batch: Any, schedule: str, pp: int, virtual: int) -> StageLayout:
    names = find_block_names(model)
    spec = resolve_schedule(schedule)
    num_stages = pp * virtual
    ranges = stage_ranges(balanced_boundaries([1] * len(names), num_stages), len(names))
    discovery = discover(model, names, lambda: model.training_step(batch, 0))
    split = StageSplit(names, [1] * len(names), ranges, [stage_owner(spec, s, pp) for s in range(num_stages)])
    return plan_stages(model, split, discovery)


def _chain(
    model: Any, batch: Any, schedule: str, pp: int, virtual: int, sum_aliases: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (by canonical name, summed over the ranks holding a weight) of the cut model."""
    layout = _layout(model, batch, schedule, pp, virtual)
    spec = resolve_schedule(schedule)
    ranks = []
    for rank in range(pp):
        copy_ = _quiet(copy.deepcopy(model))
        runtime = StageRuntime()
        cut_into_stages(copy_, layout, stages_of_rank(spec, rank, pp, virtual), runtime)
        ranks.append((copy_, runtime))
    received: torch.Tensor | None = None
    boundary_inputs, boundary_outputs = [], []
    loss = None
    for stage in range(layout.num_stages):
        copy_, runtime = ranks[layout.owners[stage]]
        runtime.active_stage, runtime.injected = stage, received
        try:
            loss = copy_.training_step(batch, 0)
        except StageExit as exit_:
            boundary_outputs.append(exit_.hidden)
            received = exit_.hidden.detach().requires_grad_()
            boundary_inputs.append(received)
        finally:
            runtime.active_stage, runtime.injected = None, None
    assert loss is not None
    # Backward stage by stage, as the schedule does: loss, then each boundary's gradient upstream.
    loss.backward()
    for out, inp in reversed(list(zip(boundary_outputs, boundary_inputs, strict=True))):
        out.backward(inp.grad)
    canonical = {alias: name for name, by_stage in layout.aliases.items() for alias in by_stage.values()}
    if not sum_aliases:
        canonical = {}
    grads: dict[str, torch.Tensor] = {}
    for copy_, _ in ranks:
        for local, param in copy_.named_parameters():
            name = canonical.get(local, local)  # a module shared by blocks: this rank's blocks' name for it
            if param.grad is not None:
                grads[name] = grads[name] + param.grad if name in grads else param.grad.clone()
    return loss.detach(), grads


def _assert_cut_matches_whole(model: Any, batch: Any) -> None:
    """Loss and every gradient of the model cut into two 1F1B stages equal the whole model's."""
    loss, grads = _chain(model, batch, "1f1b", 2, 1)
    reference = model.training_step(batch, 0)
    model.zero_grad()
    reference.backward()
    torch.testing.assert_close(loss, reference.detach())
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


CASES = [
    ("nanogpt", "1f1b", 2, 1),
    ("nanogpt", "interleaved_1f1b", 2, 2),
    ("nanogpt", "zbv", 2, 2),
    ("hf_llama", "1f1b", 2, 1),
    ("hf_llama", "interleaved_1f1b", 2, 2),
    ("recipe_gpt", "1f1b", 4, 1),
]


@pytest.mark.parametrize(("family", "schedule", "pp", "virtual"), CASES)
def test_chained_stages_equal_the_whole_model(family: str, schedule: str, pp: int, virtual: int) -> None:
    model = _quiet(FAMILIES[family](n_layer=4))
    batch = _batch()
    loss, grads = _chain(model, batch, schedule, pp, virtual)
    reference = model.training_step(batch, 0)
    model.zero_grad()
    reference.backward()
    assert torch.equal(loss, reference.detach()), (loss, reference)
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_each_rank_keeps_only_its_weights() -> None:
    model = _quiet(FAMILIES["nanogpt"](n_layer=4))
    batch = _batch()
    layout = _layout(model, batch, "1f1b", 2, 1)
    d = layout.discovery
    assert {"model.transformer.wte.weight", "model.transformer.wpe.weight"} <= d.pre_parameters
    assert "model.transformer.ln_f.weight" in d.post_parameters
    assert "model.transformer.wte.weight" in d.post_parameters  # tied to lm_head: both ends
    assert layout.tied_across_ranks() == {"model.transformer.wte.weight": (0, 1)}
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    cut_into_stages(first, layout, [0], StageRuntime())
    cut_into_stages(last, layout, [1], StageRuntime())
    first_names = {n for n, _ in first.named_parameters()}
    last_names = {n for n, _ in last.named_parameters()}
    assert "model.transformer.wpe.weight" in first_names and "model.transformer.wpe.weight" not in last_names
    assert (
        "model.transformer.ln_f.weight" in last_names and "model.transformer.ln_f.weight" not in first_names
    )
    assert not any(n.startswith("model.transformer.h.2") for n in first_names)
    assert isinstance(first.model.transformer.h[3], SkippedBlock)
    assert first_names & last_names == {"model.transformer.wte.weight"}
    # The placeholders take no memory.
    assert last.model.transformer.wpe.weight.stride() == (0, 0)


def test_a_step_that_calls_the_blocks_twice_is_refused() -> None:
    model = _quiet(FAMILIES["nanogpt"](n_layer=2))
    batch = _batch()

    def twice() -> torch.Tensor:
        model.training_step(batch, 0)
        return model.training_step(batch, 0)

    with pytest.raises(
        PipelineSetupError, match=r"called in the order \[0, 1, 0, 1\], not once each in order"
    ):
        discover(model, find_block_names(model), twice)


def test_a_step_without_a_loss_is_refused() -> None:
    model = _quiet(FAMILIES["nanogpt"](n_layer=2))
    batch = _batch()
    with pytest.raises(PipelineSetupError, match="not a scalar loss tensor"):
        discover(model, find_block_names(model), lambda: model.model(batch[0]))


@pytest.mark.parametrize("training", [True, False])
def test_a_training_step_s_outputs_are_not_kept_per_micro_batch(training: bool) -> None:
    """A step that returns its logits with the loss (a dict) would keep them for every micro-batch until the
    step ends; evaluation merges what its steps return, training needs only the loss (issue 34)."""
    from types import SimpleNamespace

    from lightning_parallel.pipeline.runner import PipelineRunner, _StepContext

    logits = torch.zeros(2, 4, 16)
    loss = logits.sum()
    ctx = _StepContext(lambda mb: {"loss": loss, "logits": logits}, [0], (), training=training)
    runner = SimpleNamespace(
        _ctx=ctx, runtime=StageRuntime(), aux_collector=None, fsdp_units=[], last_stage=0
    )
    PipelineRunner.run_stage(runner, 0, None, 0)  # type: ignore[arg-type]
    assert (ctx.outputs == {}) is training


def test_weights_that_make_every_block_s_inputs_live_on_every_stage_and_sum_their_gradients() -> None:
    torch.manual_seed(0)
    model = _quiet(FAMILIES["per_layer_inputs"]())
    batch = _batch()
    layout = _layout(model, batch, "1f1b", 2, 1)
    assert layout.discovery.side_parameters == {i: {"model.per_layer.weight"} for i in range(4)}
    assert layout.tied_across_ranks() == {"model.per_layer.weight": (0, 1)}
    _assert_cut_matches_whole(model, batch)


def test_negative_control_without_them_the_later_stage_reads_a_zero_placeholder(monkeypatch: Any) -> None:
    from lightning_parallel.pipeline.discover import DiscoveryProbe

    monkeypatch.setattr(DiscoveryProbe, "_side_parameters", lambda self: {})
    torch.manual_seed(0)
    model = _quiet(FAMILIES["per_layer_inputs"]())
    batch = _batch()
    loss, _ = _chain(model, batch, "1f1b", 2, 1)
    assert not torch.allclose(loss, model.training_step(batch, 0).detach(), rtol=1e-5)


def test_a_block_reading_what_an_earlier_block_computed_is_refused_where_no_split_avoids_it() -> None:
    model = _quiet(
        FAMILIES["per_layer_inputs"](share_state=True)
    )  # every block reads what the one before stored
    with pytest.raises(
        PipelineSetupError,
        match=r"Block model\.blocks\.2 receives, besides the hidden state, `shared`, written or returned by block"
        r" model\.blocks\.1 .* No split into 2 stages keeps every such pair of blocks on one stage",
    ):
        _layout(model, _batch(), "1f1b", 2, 1)


def test_blocks_that_hand_state_on_stay_on_one_stage_and_the_cut_model_matches() -> None:
    """Block 1 stores what block 2 reads: the balanced cut (before block 2) moves so that both run on one stage."""
    torch.manual_seed(0)
    model = _quiet(FAMILIES["per_layer_inputs"](share_state="pair"))
    batch = _batch()
    layout = _layout(model, batch, "1f1b", 2, 1)
    assert layout.discovery.handed == {(1, 2): "shared"}
    assert [r.start for r in layout.ranges] == [0, 1]  # was [0, 2]
    _assert_cut_matches_whole(model, batch)


def test_negative_control_cut_between_them_the_later_block_computes_without_the_state(
    monkeypatch: Any,
) -> None:
    from lightning_parallel.pipeline import setup

    monkeypatch.setattr(setup, "keep_handed_state_within_stages", lambda split, handed: split)
    torch.manual_seed(0)
    model = _quiet(FAMILIES["per_layer_inputs"](share_state="pair"))
    batch = _batch()
    loss, _ = _chain(model, batch, "1f1b", 2, 1)
    assert not torch.allclose(loss, model.training_step(batch, 0).detach(), rtol=1e-5)


def test_a_stage_answers_attribute_reads_of_the_blocks_it_skips_and_sends_a_contiguous_hidden_state() -> None:
    torch.manual_seed(0)
    model = _quiet(FAMILIES["per_layer_inputs"](strided_hidden=True))
    batch = _batch()
    hidden = model.model.blocks[0](model.model.embed(batch[0]), torch.zeros(2, 32, 4))
    assert not hidden.is_contiguous()  # what a block hands on: a send or receive could not take it as it is
    layout = _layout(model, batch, "1f1b", 2, 1)
    first = copy.deepcopy(model)
    runtime = StageRuntime()
    cut_into_stages(first, layout, [0], runtime)
    skipped = first.model.blocks[3]
    assert isinstance(skipped, SkippedBlock) and skipped.kind == "side input"  # the model's loop reads it
    assert not list(skipped.parameters())  # the copy answering it holds no weights of this stage
    runtime.active_stage = 0
    with pytest.raises(StageExit) as exit_:
        first.training_step(batch, 0)
    assert exit_.value.hidden.is_contiguous()
    loss, grads = _chain(model, batch, "1f1b", 2, 1)
    torch.testing.assert_close(loss, model.training_step(batch, 0).detach())


def test_negative_control_a_skipped_block_without_its_copy_cannot_answer() -> None:
    model = _quiet(FAMILIES["per_layer_inputs"]())
    layout = _layout(model, _batch(), "1f1b", 2, 1)
    with pytest.raises(AttributeError, match="kind"):
        _ = SkippedBlock("model.blocks.3", layout.discovery.template).kind


def test_a_module_shared_by_blocks_on_two_stages_lives_on_both_and_sums_its_gradient() -> None:
    """Zamba's shared transformer: each stage holding a block that calls it keeps a copy, under its own block's
    name, and the copies' gradients add up to the whole model's (the runtime sums them as a tied weight's)."""
    torch.manual_seed(0)
    model = _quiet(FAMILIES["per_layer_inputs"]())
    blocks = model.model.blocks
    blocks[3].side = blocks[0].side  # one module in two layers, blocks 0 and 3: stages 0 and 1
    batch = _batch()
    layout = _layout(model, batch, "1f1b", 2, 1)
    shared = "model.blocks.0.side.weight"
    assert layout.tied_across_ranks()[shared] == (0, 1)
    assert [layout.name_on_rank(shared, r) for r in (0, 1)] == [shared, "model.blocks.3.side.weight"]
    later = copy.deepcopy(model)
    cut_into_stages(later, layout, [1], StageRuntime())
    assert isinstance(later.model.blocks[0], SkippedBlock)
    assert later.get_parameter("model.blocks.3.side.weight") is not None  # the copy block 3 calls
    _assert_cut_matches_whole(model, batch)
    # negative control: each stage's part alone (not summed under one name) is not the gradient
    _, parts = _chain(model, batch, "1f1b", 2, 1, sum_aliases=False)
    model.zero_grad()
    model.training_step(batch, 0).backward()
    whole = model.get_parameter(shared).grad
    for part in (parts[shared], parts["model.blocks.3.side.weight"]):  # each misses the other stage's block
        assert float((part - whole).norm()) > 0.1 * float(whole.norm())
    torch.testing.assert_close(parts[shared] + parts["model.blocks.3.side.weight"], whole)


def test_a_module_shared_by_blocks_of_one_stage_needs_no_alias() -> None:
    model = _quiet(FAMILIES["per_layer_inputs"]())
    model.model.blocks[1].side = model.model.blocks[0].side
    layout = _layout(model, _batch(), "1f1b", 2, 1)
    assert layout.aliases == {} and "model.blocks.0.side.weight" not in layout.tied_across_ranks()
