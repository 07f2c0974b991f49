"""What a tensor-parallel plan leaves whole on every rank, and when that makes it a refusal.

Tensor parallelism splits attention and MLPs; anything else of a block (a small gate, a hybrid's state-space,
convolution or linear-attention mixer) runs whole on each tensor-parallel rank. A small part left whole is
noted in the plan (Jamba's and Qwen3-Next's mixers); where the plan would mostly copy the blocks instead of
splitting them, :func:`check_left_whole` refuses it at setup, naming the module: its weights, optimizer
states and compute would be paid ``tp`` times for little memory saved.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_parallel.experts import find_moe_blocks
from lightning_parallel.plans.detect import containers_in, join
from lightning_parallel.tensor_parallel.param_styles import LocalParameters
from lightning_parallel.tensor_parallel.plan import ParallelPlan

__all__ = ["check_left_whole", "sum_shares_over_tp"]


def _matrix_numel(model: nn.Module, module_name: str) -> int:
    return sum(p.numel() for p in model.get_submodule(module_name).parameters() if p.dim() == 2)


def _other_block_stack(model: nn.Module, plan: ParallelPlan) -> str | None:
    """A second list of blocks with attention or MLP projections, outside the planned stack (HRM's high- and
    low-level modules): the plan covers one stack, so it would stay whole on every rank."""
    stack = plan.block_list or ""
    for name, module in model.named_modules():
        inside = name == stack or name.startswith(stack + ".") or stack.startswith(name + ".")
        if inside or not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) == 1 and any(containers_in(child) for child in module):
            return name
    return None


def _split_and_whole(model: nn.Module, plan: ParallelPlan) -> tuple[int, int]:
    """Matrix elements of the block stack the plan gives a style (split, or read as the split parts need
    them: a latent's down-projection), and those it leaves whole. Experts are expert parallelism's to split
    and counted in neither."""
    experts = {n for info in find_moe_blocks(model) for n in info.expert_param_names}
    split_modules = {n for n, style in plan.styles.items() if not isinstance(style, SequenceParallel)}
    split = whole = 0
    for block in plan.block_names:
        for name, param in model.get_submodule(block).named_parameters():
            full = join(block, name)
            if param.dim() != 2 or full in experts:
                continue
            if full.rsplit(".", 1)[0] in split_modules:
                split += param.numel()
            else:
                whole += param.numel()
    return split, whole


def _mostly_whole(
    model: nn.Module, plan: ParallelPlan, replicated: list[tuple[str, str]], mixers: list[tuple[str, str]]
) -> tuple[str, str] | None:
    """Why tensor parallelism would mostly copy the blocks rather than split them (None: it splits most):
    a block whose only token mixer stays whole with nothing else to split, a second block stack the plan
    does not cover, or modules left whole holding more of the blocks' matrix weights than the split part."""
    planned_blocks = {b for b in plan.block_names for c in plan.containers if c.name.startswith(b + ".")}
    for name, reason in mixers:
        block = next(b for b in plan.block_names if name.startswith(b + "."))
        if block not in planned_blocks:
            return name, f"{reason}; nothing else of block `{block}` can be split"
    other = _other_block_stack(model, plan)
    if other is not None:
        return other, f"a second stack of blocks beside `{plan.block_list}`, which the plan splits"
    split, whole = _split_and_whole(model, plan)
    if whole > split and replicated:
        name, reason = max(replicated, key=lambda item: _matrix_numel(model, item[0]))
        return (
            name,
            f"{reason}; the blocks' matrix weights left whole number {whole} elements, those split {split}",
        )
    # what stays whole was never a candidate (an attention of wrapped projections, Inkling 2's)
    if whole > split:
        block = plan.block_names[0]
        found = (
            ", ".join(f"`{c.name}`" for c in plan.containers if c.name.startswith(block + ".")) or "nothing"
        )
        return (
            block,
            f"of its modules the plan found {found} to split; the blocks' matrix weights left whole number"
            f" {whole} elements, those split {split}",
        )
    return None


def _owner_name(model: nn.Module, plan: ParallelPlan) -> str:
    """The class of the module whose blocks these are (Hugging Face's ``MambaModel``, not the LightningModule or
    the causal-LM wrapper around it)."""
    parent = (plan.block_list or "").rpartition(".")[0]  # the module holding the list
    return type(model.get_submodule(parent) if parent else model).__name__


def check_left_whole(
    model: nn.Module, plan: ParallelPlan, replicated: list[tuple[str, str]], mixers: list[tuple[str, str]]
) -> None:
    """Modules of the blocks left whole: noted in the plan; a refusal when nothing of the blocks is split
    (blocks without attention or MLP projections tensor parallelism can find: it would only copy them), when
    token mixers that are neither attention nor an MLP (state-space, convolution, linear attention) make up a
    block or most of a hybrid stack (tensor parallelism would mostly copy it: weights, optimizer states and
    compute on every rank), or under sequence parallelism (they would run on a slice of the sequence).
    A hybrid whose mixers are a small part (Jamba's, Qwen3-Next's) keeps them whole, noted in the plan."""
    first, why = (
        replicated[0] if replicated else (plan.block_names[0], "no attention or MLP projections found")
    )
    fix = (
        " Use tensor_parallel=1 (pipeline, expert and data parallelism and ZeRO apply), or pass `plan=` with"
    )
    if not plan.containers:
        raise ValueError(
            f"`tensor_parallel={plan.tensor_parallel}`: no block of {_owner_name(model, plan)} has an attention or MLP"
            f" that tensor parallelism can split: `{first}` ({why}) is not one.{fix} styles of your own."
        )
    mostly_whole = _mostly_whole(model, plan, replicated, mixers)
    if mostly_whole is not None:
        name, reason = mostly_whole
        raise ValueError(
            f"`tensor_parallel={plan.tensor_parallel}`: tensor parallelism cannot split `{name}` ({reason}), and"
            " would mostly copy this model's blocks on every tensor-parallel rank (weights, optimizer states and"
            f" compute) instead of splitting them.{fix} styles of your own for the modules you want split."
        )
    if not replicated:
        return
    if plan.sequence_parallel:
        _run_on_the_whole_sequence(plan, replicated)
    for name, reason in replicated:
        plan.notes.append(f"{name}: left replicated ({reason})")


def _run_on_the_whole_sequence(plan: ParallelPlan, replicated: list[tuple[str, str]]) -> None:
    """Under sequence parallelism each rank holds a slice of the sequence between the blocks' containers. A
    module left whole inside a split container reads the container's input, which is gathered already; one
    called by the block itself (a state-space mixer, a sparse-attention indexer beside the attention) runs on
    the whole sequence: gathered entering it, this rank's slice of its output leaving it (the same on every
    rank, as a replicated module is under tensor parallelism without sequence parallelism). A block that is
    itself what stays whole (its own projections: Gemma 3n's per-layer input gate) computes per token on its
    slice, like the rest of the region (:func:`sum_shares_over_tp`)."""
    split = [c.name for c in plan.containers]
    for name, _ in replicated:
        if any(name.startswith(c + ".") for c in split) or name in plan.block_names:
            continue  # a block's own projections (a per-layer gate): per token, see `sum_shares_over_tp`
        plan.whole_sequence.append(name)
        plan.notes.append(f"{name}: runs on the whole sequence (gathered entering it, sliced leaving it)")


def sum_shares_over_tp(model: nn.Module, plan: ParallelPlan) -> None:
    """Under sequence parallelism, the blocks' parameters no style covers (a block's own scalars, as Doge's
    ``input_residual``; a per-layer input gate's projections) are used by each rank on its slice of the
    sequence, per token: each rank's gradient is its tokens' share. They are kept whole with a ``Partial``
    gradient (``LocalParameters``), summed over ``tp`` once per step, as the norms' and the experts' are. A
    module run on the whole sequence, or inside a split container (which gathers its input), has whole
    gradients already."""
    if not plan.sequence_parallel:
        return
    covered = [c.name for c in plan.containers] + list(plan.styles) + plan.whole_sequence
    for block_name in plan.block_names:
        if block_name in covered:
            continue
        dims: dict[str, int | None] = {}  # one style on the block: its code may read its children's weights
        for sub_name, sub in model.get_submodule(block_name).named_modules():
            full = join(block_name, sub_name)
            if any(full == c or full.startswith(c + ".") for c in covered):
                continue
            dims.update(
                {join(sub_name, n): None for n, p in sub.named_parameters(recurse=False) if p.requires_grad}
            )
        if dims:
            plan.styles[block_name] = LocalParameters(dims)
