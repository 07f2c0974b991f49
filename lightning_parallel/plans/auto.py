"""``plan="auto"``: derive a Megatron-style tensor/sequence-parallel plan from an unchanged model.

Per block container (attention or MLP): entries column-parallel, exit row-parallel, head-count
and width attributes divided by the degree. The token embedding is vocabulary-parallel, the
output head column-parallel with its logits gathered (so the user's unchanged loss code sees
ordinary logits). Norms stay replicated; under sequence parallelism they run on sequence
shards (torch's ``SequenceParallel``). A layout that cannot be split evenly is a ``ValueError``
naming the module, the attribute and the degrees that would work.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

from lightning_parallel.experts import find_moe_blocks
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
    head_count,
    head_dim_of,
    join,
    kv_head_count,
    norms_in,
)
from lightning_parallel.tensor_parallel.norm_styles import GatheredNorm, HeadShardedNorm
from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer
from lightning_parallel.tensor_parallel.row_layout import RowLayout
from lightning_parallel.tensor_parallel.styles import ColwiseProjection, RowwiseProjection, projection_dims


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _require_divisible(value: int, tp: int, what: str, module: str) -> None:
    if value % tp != 0:
        raise ValueError(
            f"`tensor_parallel={tp}` does not divide the {value} {what} of `{module}`."
            f" Choose tensor_parallel among {_divisors(value)}, or exclude the module with `plan=`."
        )


def exit_style(sequence_parallel: bool) -> RowwiseProjection:
    return RowwiseProjection(
        input_layouts=Shard(-1),
        output_layouts=Shard(1) if sequence_parallel else Replicate(),
        use_local_output=True,
    )


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """K/V heads a rank holds: its share, or one when there are fewer than ranks (each shared by ``tp / kv_heads``)."""
    return max(kv_heads // tp, 1)


def scaled_attributes(module: nn.Module, tp: int, known: dict) -> dict[str, tuple[int, int]]:
    """Integer attributes the module's forward may read, scaled to the local shard."""
    heads, kv_heads = known.get("heads"), known.get("kv_heads")
    kv_local = local_kv_heads(kv_heads, tp) if kv_heads else None
    scaled: dict[str, tuple[int, int]] = {}
    for key, value in vars(module).items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if HEAD_COUNT_ATTRS.match(key) and value == heads:
            scaled[key] = (value, value // tp)
        elif KV_HEAD_COUNT_ATTRS.match(key) and value == kv_heads:
            scaled[key] = (value, kv_local)
        elif KV_GROUP_ATTRS.match(key) and heads and kv_heads and value == heads // kv_heads:
            if (
                heads // tp // kv_local != value
            ):  # query heads per k/v head, locally: fewer k/v heads than ranks
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
    import inspect

    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def plan_attention(
    full_name: str, cand: ContainerCandidate, tp: int, sp: bool
) -> tuple[ShardedContainer, dict]:
    module = cand.module
    exit_in, hidden = projection_dims(cand.exit[1])
    heads = head_count(module)
    head_dim = head_dim_of(module)
    if heads is None and head_dim:
        heads = exit_in // head_dim
    if heads is None:
        raise ValueError(
            f"Cannot find the number of attention heads of `{full_name}` ({type(module).__name__}): it has no"
            " attribute such as `n_head`, `num_heads` or `head_dim`. Pass `plan=` with explicit styles."
        )
    head_dim = head_dim or exit_in // heads
    kv_heads = kv_head_count(module)
    if kv_heads is None and len(cand.entries) == 3:
        kv_heads = projection_dims(cand.entries[1][1])[1] // head_dim  # from the key projection's width
    if (
        kv_heads is None and len(cand.entries) == 1
    ):  # a fused q|k|v: its width tells (multi-query GPT-BigCode)
        fused = projection_dims(cand.entries[0][1])[1] // head_dim - heads
        kv_heads = fused // 2 if fused > 0 and fused % 2 == 0 and fused // 2 != heads else None
    kv_heads = kv_heads or heads
    _require_divisible(heads, tp, "attention heads", full_name)
    if kv_heads >= tp or tp % kv_heads:
        _require_divisible(kv_heads, tp, "key/value heads", full_name)
    styles: dict = {}
    variants: list[tuple[str, dict]] = []
    kv_width = kv_heads * head_dim
    for name, entry in cand.entries:
        entry_in, entry_out = projection_dims(entry)
        if entry_in != hidden:
            _refuse_latent_attention(full_name, name, entry_in, cand, hidden)
            raise ValueError(
                f"`{join(full_name, name)}` reads {entry_in} features but the attention output is {hidden} wide;"
                " lightning_parallel cannot tell how to split it. Pass `plan=` with explicit styles."
            )
        if (
            len(cand.entries) == 1 and entry_out != exit_in
        ):  # a fused projection: its layouts, by verification
            layouts = fused_layouts(join(full_name, name), entry_out, heads, kv_heads, head_dim, tp)
            variants = [(label, {join(full_name, name): style}) for label, style in layouts]
            styles.update(variants[0][1])
        elif kv_heads < tp and entry_out == kv_width and kv_width != exit_in:  # k/v of fewer heads than ranks
            layout = RowLayout.of_blocks(
                [(kv_width, kv_heads)], tp, label=f"{kv_heads} k/v heads, each on {tp // kv_heads} ranks"
            )
            styles[join(full_name, name)] = ColwiseProjection(row_layout=layout, use_local_output=True)
        else:
            styles[join(full_name, name)] = ColwiseProjection(use_local_output=True)
    styles[join(full_name, cand.exit[0])] = exit_style(sp)
    styles.update(attention_norm_styles(module, full_name, head_dim, {exit_in, kv_heads * head_dim}))
    widths = {hidden, exit_in, 3 * exit_in} | ({kv_width} if kv_heads >= tp else set())
    scaled = scaled_attributes(module, tp, {"heads": heads, "kv_heads": kv_heads, "widths": widths})
    container = ShardedContainer(
        name=full_name,
        kind="attention",
        entries=[join(full_name, n) for n, _ in cand.entries],
        exit=join(full_name, cand.exit[0]),
        scaled_attributes=scaled,
        hidden_size=hidden,
        variants=variants,
        heads=heads,
    )
    return container, styles


def _refuse_latent_attention(
    full_name: str, name: str, width: int, cand: ContainerCandidate, hidden: int
) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): per-head projections read a low-rank latent that
    another projection makes from the hidden state; not sharded yet (a clear refusal, not a guess)."""
    latent = [
        n for n, m in cand.entries if projection_dims(m)[0] == hidden and projection_dims(m)[1] >= width
    ]
    if latent:
        raise ValueError(
            f"`{full_name}` ({type(cand.module).__name__}) is multi-head latent attention: `{name}` reads a"
            f" {width}-wide latent made by `{latent[0]}` from the hidden state, which tensor parallelism does not"
            " shard yet. Train it with tensor_parallel=1 (expert, pipeline, data parallelism and ZeRO apply), or"
            " pass `plan=` with styles for its other modules only."
        )


def fused_layouts(
    name: str, width: int, heads: int, kv_heads: int, head_dim: int, tp: int
) -> list[tuple[str, object]]:
    """How a fused q|k|v projection of ``width`` outputs may lay its rows out, in the order the verification
    tries them (it keeps the first that reproduces the unsharded block).

    - ``q|k|v``: three equal blocks (GPT-2's ``c_attn``, nanoGPT): each rank takes its slice of each
      (torch's ``_StridedShard``);
    - ``per head``/``per k/v group``: the rows of each head's (or each k/v group's) q, k and v next to each
      other (GPT-NeoX, Bloom, Persimmon; Falcon's grouped layout): each rank takes a contiguous block of
      whole heads (groups);
    - ``q|k|v blocks``: a block of query rows, then fewer key and value rows (Phi-3's ``qkv_proj``;
      GPT-BigCode's multi-query ``c_attn``): each rank stores its query heads and the k/v heads they use,
      in another row order than the user's (``tensor_parallel/row_layout.py``); with fewer k/v heads than
      ranks a k/v head is on several ranks.
    """
    if width == 3 * heads * head_dim and kv_heads == heads:
        return [
            ("q|k|v", ColwiseProjection(num_chunks=3, use_local_output=True)),
            ("per head", ColwiseProjection(use_local_output=True)),
        ]
    if width == (heads + 2 * kv_heads) * head_dim:
        blocks = [(heads * head_dim, heads), (kv_heads * head_dim, kv_heads), (kv_heads * head_dim, kv_heads)]
        rows = RowLayout.of_blocks(blocks, tp, label="q|k|v blocks")
        layouts = [("q|k|v blocks", ColwiseProjection(row_layout=rows, use_local_output=True))]
        if kv_heads % tp == 0:
            layouts.insert(0, ("per k/v group", ColwiseProjection(use_local_output=True)))
        return layouts
    raise ValueError(
        f"`{name}` fuses projections of unequal widths ({width} outputs for {heads} query and {kv_heads}"
        f" key/value heads of {head_dim}); this split is not supported."
    )


# Where a per-head norm's input is marked sharded: the heads' dimension of (batch, sequence, heads,
# head_dim). Any dimension but the last gives the same local arithmetic (the norm reduces over the last).
HEADS_DIM = -2


def attention_norm_styles(attention: nn.Module, full_name: str, head_dim: int, widths: set[int]) -> dict:
    """Norms inside an attention (query/key norms), by the shape of their weight (``tensor_parallel/norm_styles.py``).

    - ``head_dim`` entries, shared by every head (Qwen3's, Gemma 3's): each rank normalises its own heads
      with the one weight, whose gradient is then a partial sum over the ranks. Torch's
      ``SequenceParallel`` style over the heads' dimension makes the weight a replicated DTensor and
      the input a head-sharded one, so that gradient is summed (as for sequence-parallel norms).
    - ``(heads, head_dim)``, a weight per head (Cohere's): cut along the heads like the input.
    - a whole projection's width (``widths``: OLMo 2's, OLMoE's): its statistics span heads other ranks
      hold; the input is gathered and the norm runs whole.
    """
    styles: dict = {}
    for name in norms_in(attention, set()):
        norm = attention.get_submodule(name)
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() == 1 and weight.numel() == head_dim:
            styles[join(full_name, name)] = SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
        elif weight.dim() == 2 and weight.shape[-1] == head_dim:
            styles[join(full_name, name)] = HeadShardedNorm()
        elif weight.dim() == 1 and weight.numel() in widths:
            styles[join(full_name, name)] = GatheredNorm(dim=-1)
    return styles


def plan_mlp(full_name: str, cand: ContainerCandidate, tp: int, sp: bool) -> tuple[ShardedContainer, dict]:
    ffn, hidden = projection_dims(cand.exit[1])
    _require_divisible(ffn, tp, "hidden units", full_name)
    styles: dict = {}
    for name, entry in cand.entries:
        entry_in, entry_out = projection_dims(entry)
        if (
            entry_in != hidden
            or entry_out not in (ffn, 2 * ffn)
            or (entry_out == 2 * ffn and len(cand.entries) > 1)
        ):
            raise ValueError(
                f"`{join(full_name, name)}` ({entry_in}->{entry_out}) does not fit the MLP pattern around"
                f" `{join(full_name, cand.exit[0])}` ({ffn}->{hidden}). Pass `plan=` with explicit styles."
            )
        chunks = 2 if entry_out == 2 * ffn else 1  # fused gate|up
        styles[join(full_name, name)] = ColwiseProjection(num_chunks=chunks, use_local_output=True)
    styles[join(full_name, cand.exit[0])] = exit_style(sp)
    container = ShardedContainer(
        name=full_name,
        kind="mlp",
        entries=[join(full_name, n) for n, _ in cand.entries],
        exit=join(full_name, cand.exit[0]),
        scaled_attributes=scaled_attributes(cand.module, tp, {"widths": {ffn, 2 * ffn}}),
        hidden_size=hidden,
    )
    return container, styles


def _refuse_experts_under_sequence_parallelism(blocks: nn.ModuleList, names: list[str]) -> None:
    """MoE blocks are not tensor-parallel (their experts are replicated over ``tp``); under sequence parallelism
    each rank would route and train them on its slice of the sequence only (gradients partial over ``tp``)."""
    for name, block in zip(names, blocks, strict=True):
        found = find_moe_blocks(block)
        if found:
            raise ValueError(
                f"`sequence_parallel=True` with the Mixture-of-Experts block `{join(name, found[0].name)}`: MoE"
                " blocks are not tensor-parallel, and under sequence parallelism each rank would route only its"
                " slice of the sequence through them. Use sequence_parallel=False (tensor parallelism still shards"
                " the attention), and `expert_parallel=` to spread the experts."
            )


def auto_plan(model: nn.Module, tensor_parallel: int, sequence_parallel: bool) -> ParallelPlan:
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
    if sp:
        _refuse_experts_under_sequence_parallelism(stack.blocks, stack.names)
    for index, block in enumerate(stack.blocks):
        block_name = plan.block_names[index]
        candidates = containers_in(block)
        if not candidates:
            plan.notes.append(f"{block_name}: no attention/MLP projections found; left replicated")
        for cand in candidates:
            full = join(block_name, cand.name)
            planner = plan_attention if cand.looks_like_attention() else plan_mlp
            container, styles = planner(full, cand, tp, sp)
            plan.containers.append(container)
            plan.styles.update(styles)
        if sp:
            for norm in norms_in(block, {c.name for c in candidates}):
                plan.norms.append(join(block_name, norm))
                plan.styles[join(block_name, norm)] = SequenceParallel(use_local_output=True)
    embedding = find_token_embedding(model, stack.name)
    if embedding is not None:
        name, emb = embedding
        if emb.num_embeddings % tp == 0:
            plan.styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        else:
            plan.notes.append(f"{name}: vocabulary {emb.num_embeddings} not divisible by {tp}; replicated")
        head = find_output_head(model, emb.num_embeddings, stack.name)
        if head is not None and emb.num_embeddings % tp == 0:
            plan.styles[head[0]] = ColwiseProjection(output_layouts=Replicate(), use_local_output=True)
            plan.head = head[0]
    return plan
