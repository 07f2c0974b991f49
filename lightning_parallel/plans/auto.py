"""``plan="auto"``: derive a Megatron-style tensor/sequence-parallel plan from an unchanged model.

Per block container (attention or MLP): entries column-parallel, exit row-parallel, head-count
and width attributes divided by the degree. The token embedding is vocabulary-parallel, the
output head column-parallel with its logits gathered (so the user's unchanged loss code sees
ordinary logits). Norms stay replicated; under sequence parallelism they run on sequence
shards (torch's ``SequenceParallel``). A layout that cannot be split evenly is a ``ValueError``
naming the module, the attribute and the degrees that would work.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from lightning_parallel.experts import find_moe_blocks
from lightning_parallel.plans.attention import (
    UnsupportedLayout,
    attention_norm_styles,
    choose_exit,
    heads_of,
    helper_styles,
    local_kv_heads,
    make_container,
    own_tensor_styles,
    paired_heads_styles,
    plan_attention_entries,
    require_divisible,
)
from lightning_parallel.plans.detect import (
    HEAD_COUNT_ATTRS,
    KV_GROUP_ATTRS,
    KV_HEAD_COUNT_ATTRS,
    WIDTH_ATTRS,
    ContainerCandidate,
    containers_in,
    find_block_stack,
    find_output_head,
    find_token_embedding,
    join,
    norms_in,
    sequence_mixer,
)
from lightning_parallel.plans.left_whole import check_left_whole, sum_shares_over_tp
from lightning_parallel.tensor_parallel.norm_styles import GatheredNorm, ResidualNorm
from lightning_parallel.tensor_parallel.param_styles import LocalParameters
from lightning_parallel.tensor_parallel.plan import EntryVariant, ParallelPlan, ShardedContainer
from lightning_parallel.tensor_parallel.styles import (
    ColwiseProjection,
    RowwiseProjection,
    TokenEmbedding,
    projection_dims,
)


def exit_style(*, sequence_parallel: bool) -> RowwiseProjection:
    return RowwiseProjection(
        input_layouts=Shard(-1),
        output_layouts=Shard(1) if sequence_parallel else Replicate(),
        use_local_output=True,
    )


def scaled_attributes(module: nn.Module, tp: int, known: dict) -> dict[str, tuple[int, int]]:
    """Integer attributes the module's forward may read, scaled to the local shard."""
    heads, kv_heads = known.get("heads"), known.get("kv_heads")
    kv_local = known.get("kv_local") or (local_kv_heads(kv_heads, tp) if kv_heads else None)
    scaled: dict[str, tuple[int, int]] = {}
    for key, value in vars(module).items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if HEAD_COUNT_ATTRS.match(key) and value == heads:
            scaled[key] = (value, value // tp)
        elif KV_HEAD_COUNT_ATTRS.match(key) and value == kv_heads:
            scaled[key] = (value, kv_local)
        elif KV_GROUP_ATTRS.match(key) and heads and kv_heads and value == heads // kv_heads:
            # query heads per k/v head, locally: fewer k/v heads than ranks
            if heads // tp // kv_local != value:
                scaled[key] = (value, heads // tp // kv_local)
        elif WIDTH_ATTRS.match(key) and value in known.get("widths", ()):
            scaled[key] = (value, value // tp)
    # Head counts its forward reads from the config while it runs (Phi-3's `self.config.num_attention_heads`).
    config = getattr(module, "config", None) if heads else None
    source = _forward_source(module) if config is not None else ""
    for key, value in vars(config).items() if config is not None else ():
        if isinstance(value, int) and not isinstance(value, bool) and f"config.{key}" in source:
            if HEAD_COUNT_ATTRS.match(key) and value == heads:
                scaled[f"config.{key}"] = (value, value // tp)
            elif KV_HEAD_COUNT_ATTRS.match(key) and value == kv_heads:
                scaled[f"config.{key}"] = (value, kv_local)
    return scaled


def _forward_source(module: nn.Module) -> str:
    """The source of ``module``'s ``forward`` ("" where Python cannot show it)."""

    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def plan_attention(
    full_name: str, cand: ContainerCandidate, tp: int, *, sp: bool, model_width: int | None = None
) -> tuple[ShardedContainer, dict]:
    """Entries column parallel, exit row parallel, head counts divided (``plans/attention.py``)."""
    module = cand.module
    exit_name, exit_module = choose_exit(cand, model_width)
    exit_in, hidden = projection_dims(exit_module)
    heads, head_dim = heads_of(full_name, module, exit_in)
    styles, variants, kv_heads, makers = plan_attention_entries(
        full_name, cand, exit_name, tp, hidden, heads, head_dim
    )
    styles[join(full_name, exit_name)] = exit_style(sequence_parallel=sp)
    kv_width = kv_heads * head_dim
    latents = {projection_dims(m)[0] for _, m in cand.projections} - {hidden, exit_in}
    norms = attention_norm_styles(module, full_name, head_dim, {exit_in, kv_width})
    for name in norms_in(module, set()):  # norms of the latents or the shared rotary key: whole, grads summed
        norm = module.get_submodule(name)
        weight = getattr(norm, "weight", None)
        if (
            makers
            and isinstance(weight, torch.Tensor)
            and (weight.numel() in latents or join(full_name, name) not in norms)
        ):
            norms.pop(join(full_name, name), None)
            norms.update(own_tensor_styles(norm, join(full_name, name), {}))
    styles.update(norms)
    handled = set(styles) | {join(full_name, n) for n in makers}
    handled |= {join(full_name, n) for n in norms_in(module, set())}
    per_head = {heads: "heads"} if heads > 1 else {}
    styles.update(own_tensor_styles(module, full_name, per_head, returned_whole=not sp))
    styles.update(helper_styles(module, full_name, per_head, handled))
    widths = {hidden, exit_in, 3 * exit_in} | ({kv_width} if kv_heads >= tp else set())
    scaled = scaled_attributes(module, tp, {"heads": heads, "kv_heads": kv_heads, "widths": widths})
    paired = (
        None
        if variants or makers
        else paired_heads_styles(full_name, cand, exit_name, hidden, heads, kv_heads, head_dim, tp)
    )
    if paired is not None:  # which one the verification decides
        pair_styles, kv_local = paired
        known = {"heads": heads, "kv_heads": kv_heads, "widths": widths, "kv_local": kv_local}
        variants = [
            EntryVariant("", {}, fused=False),  # the plain split: nothing to say in the plan
            EntryVariant(
                "heads paired across halves", pair_styles, scaled_attributes(module, tp, known), fused=False
            ),
        ]
    container = make_container(
        full_name, cand, exit_name, makers, hidden, heads, scaled_attributes=scaled, variants=variants
    )
    return container, styles


def plan_mlp(full_name: str, cand: ContainerCandidate, tp: int, *, sp: bool) -> tuple[ShardedContainer, dict]:
    """Entries (up, gate, or a fused gate|up) column parallel, the exit row parallel; a norm over the hidden
    units before the exit (BitNet's ``ffn_sub_norm``) gathered, a learnable activation's weights summed."""
    ffn, hidden = projection_dims(cand.exit[1])
    if not cand.name and ffn < hidden:
        raise UnsupportedLayout(
            f"projections of the block itself that narrow its {hidden}-wide hidden state to {ffn} (a per-layer"
            " input gate or an adapter, not an MLP): small, left whole"
        )
    styles: dict = {}
    for name, entry in cand.entries:
        entry_in, entry_out = projection_dims(entry)
        if (
            entry_in != hidden
            or entry_out not in (ffn, 2 * ffn)
            or (entry_out == 2 * ffn and len(cand.entries) > 1)
        ):
            raise UnsupportedLayout(
                f"`{join(full_name, name)}` ({entry_in}->{entry_out}) does not fit the MLP pattern around"
                f" `{join(full_name, cand.exit[0])}` ({ffn}->{hidden})"
            )
        chunks = 2 if entry_out == 2 * ffn else 1  # fused gate|up
        styles[join(full_name, name)] = ColwiseProjection(num_chunks=chunks, use_local_output=True)
    require_divisible(ffn, tp, "hidden units", full_name)
    styles[join(full_name, cand.exit[0])] = exit_style(sequence_parallel=sp)
    norms = norms_in(cand.module, set())
    for name in norms:
        weight = getattr(cand.module.get_submodule(name), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == ffn:
            styles[join(full_name, name)] = GatheredNorm(dim=-1)
    handled = set(styles) | {join(full_name, n) for n in norms}
    styles.update(helper_styles(cand.module, full_name, {ffn: "hidden units"}, handled))
    container = ShardedContainer(
        name=full_name,
        kind="mlp",
        entries=[join(full_name, n) for n, _ in cand.entries],
        exit=join(full_name, cand.exit[0]),
        scaled_attributes=scaled_attributes(cand.module, tp, {"widths": {ffn, 2 * ffn}}),
        hidden_size=hidden,
    )
    return container, styles


def _experts_on_sequence_shards(plan: ParallelPlan, blocks: nn.ModuleList, names: list[str]) -> list[str]:
    """Under sequence parallelism each rank routes its own slice of the sequence through the MoE blocks, whose
    router and experts stay whole on every tensor-parallel rank (Megatron's expert tensor parallelism of 1:
    the tp ranks are more token shards for the experts). Routing is per token, so each token meets the
    experts it meets in one process; the weights' gradients, each rank's tokens' share, are summed over
    ``tp`` (``LocalParameters``: a ``Partial`` gradient). Shared experts planned as MLPs keep their styles.
    Returns the MoE blocks' names."""
    found = []
    for block_name, block in zip(names, blocks, strict=True):
        for info in find_moe_blocks(block):
            moe = join(block_name, info.name)
            if info.kind == "lightning_parallel":
                raise ValueError(
                    f"`sequence_parallel=True` with the MoE layer `{moe}`: this library's MoE counts expert capacity"
                    " and its auxiliary loss over the tokens it sees, which under sequence parallelism would be each"
                    " rank's slice of the sequence. Use sequence_parallel=False (tensor parallelism still splits"
                    " the attention), or expert_parallel= with data parallelism."
                )
            found.append(moe)
            planned = [c.name for c in plan.containers] + list(plan.styles)
            # one style on the block: its code may read its children's weights
            dims: dict[str, int | None] = {}
            for sub_name, sub in info.block.named_modules():
                full = join(moe, sub_name)
                if any(full == p or full.startswith(p + ".") for p in planned):
                    continue
                # frozen ones (ERNIE 4.5's routing statistics) stay plain: the same on every rank, never trained
                dims.update(
                    {
                        join(sub_name, n): None
                        for n, p in sub.named_parameters(recurse=False)
                        if p.requires_grad
                    }
                )
            if dims:
                plan.styles[moe] = LocalParameters(dims)
            plan.notes.append(
                f"{moe}: experts and router whole on every tp rank, each routing its sequence slice"
            )
    return found


def _adds_its_own_aux_loss(model: nn.Module) -> bool:
    """A Hugging Face MoE model set to add its routers' load-balancing loss to the loss it returns."""
    return any(
        getattr(getattr(m, "config", None), "output_router_logits", False) is True for m in model.modules()
    )


def _model_width(model: nn.Module, stack: str) -> int | None:
    """The width of the residual stream: the token embedding's (the exit of an attention writes it)."""
    embedding = find_token_embedding(model, stack)
    return embedding[1].embedding_dim if embedding is not None else None


def auto_plan(model: nn.Module, tensor_parallel: int, *, sequence_parallel: bool) -> ParallelPlan:
    """Discover the Megatron-style plan of ``model`` for ``tensor_parallel`` ranks."""
    tp, sp = tensor_parallel, sequence_parallel
    plan = ParallelPlan(tensor_parallel=tp, sequence_parallel=sp)
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(
            f"{type(model).__name__} has no repeated block list (an nn.ModuleList of identical layers), so"
            " `plan='auto'` cannot find what to shard. Pass `plan=` with a dict of module-name patterns."
        )
    plan.block_list = stack.name
    plan.block_names = stack.names
    width = _model_width(model, stack.name)
    replicated: list[tuple[str, str]] = []  # (module, why): what tensor parallelism leaves whole
    whole_mixers: list[tuple[str, str]] = []  # those of them that mix tokens otherwise than attention
    for index, block in enumerate(stack.blocks):
        block_name = plan.block_names[index]
        candidates = containers_in(block)
        if not candidates:
            plan.notes.append(f"{block_name}: no attention/MLP projections found; left replicated")
        mixers = [c.name for c in candidates if sequence_mixer(c.module)]
        for cand in candidates:
            full = join(block_name, cand.name)
            why = sequence_mixer(cand.module)
            if why is None and any(cand.name.startswith(m + ".") for m in mixers):
                continue  # inside a mixer that stays whole
            try:
                if why is not None:
                    raise UnsupportedLayout(why)
                if cand.looks_like_attention():
                    container, styles = plan_attention(full, cand, tp, sp=sp, model_width=width)
                else:
                    container, styles = plan_mlp(full, cand, tp, sp=sp)
            except UnsupportedLayout as error:
                replicated.append((full, f"{type(cand.module).__name__}: {error}"))
                if why is not None:
                    whole_mixers.append(replicated[-1])
                continue
            plan.containers.append(container)
            plan.styles.update(styles)
        if sp:
            for norm in norms_in(block, {c.name for c in candidates}):
                plan.norms.append(join(block_name, norm))
                plan.styles[join(block_name, norm)] = ResidualNorm()
    if sp:  # the MoE blocks run whole on each rank's slice of the sequence: not left replicated
        moe = _experts_on_sequence_shards(plan, stack.blocks, plan.block_names)
        if moe and _adds_its_own_aux_loss(model):
            raise ValueError(
                f"`sequence_parallel=True` with the Mixture-of-Experts block `{moe[0]}`: the model adds its own"
                " router auxiliary loss (config.output_router_logits=True), which under sequence parallelism each"
                " rank would compute from its slice of the sequence only. Set output_router_logits=False and pass"
                " `moe_aux_loss_coef=` to the strategy (it counts routing over the whole batch), or use"
                " sequence_parallel=False."
            )
        replicated = [
            (n, why) for n, why in replicated if not any(n == m or n.startswith(m + ".") for m in moe)
        ]
    check_left_whole(model, plan, replicated, whole_mixers)
    sum_shares_over_tp(model, plan)
    embedding = find_token_embedding(model, stack.name)
    if embedding is not None:
        name, emb = embedding
        # an embedding running modules of its own on the lookup (Inkling 2's norm) would hand them the vocabulary
        # shard's partial rows: left whole, with a head tied to it
        nested = [child for child, _ in emb.named_children()]
        if nested:
            plan.notes.append(f"{name}: left replicated (it runs {', '.join(nested)} on the lookup itself)")
        elif emb.num_embeddings % tp == 0:
            plan.styles[name] = TokenEmbedding(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            plan.notes.append(f"{name}: vocabulary {emb.num_embeddings} not divisible by {tp}; replicated")
        head = find_output_head(model, emb.num_embeddings, stack.name)
        tied = head is not None and getattr(head[1], "weight", None) is emb.weight
        if head is not None and emb.num_embeddings % tp == 0 and not (nested and tied):
            plan.styles[head[0]] = ColwiseProjection(output_layouts=Replicate(), use_local_output=True)
            plan.head = head[0]
    return plan
