"""How an attention module is split over the tensor-parallel ranks: by its heads, whatever else it holds.

Its projections that read the hidden state and write one row block per head are column parallel, the one
that writes the hidden state back (the exit) row parallel, and head counts in its attributes are divided.
Around that, each kind of attention found in the wild is recognised by shape, not by class:

- fused q|k|v projections of any row layout (``fused_layouts``: three blocks, per head, per k/v group,
  q|k|v blocks of unequal widths): the block verification picks the layout that reproduces the block;
- multi-head latent attention (DeepSeek-V2/V3, Kimi, MiniCPM3, ...): projections that read a low-rank
  latent (``q_b_proj``, ``kv_b_proj``) made by a projection of the hidden state (``q_a_proj``,
  ``kv_a_proj_with_mqa``) are column parallel; the latent makers and their norms stay whole on every rank
  (the latent is small), and the readers' input gradients are summed over the ranks before reaching them;
- norms inside the attention (``attention_norm_styles``): per head, per head with a weight each, or over
  the whole projection width;
- tensors of its own with one entry per head (attention sinks, per-head decay rates) cut like the heads,
  and other parameters it uses on its heads (differential attention's ``lambda`` vectors) kept whole with
  their gradient summed (``tensor_parallel/param_styles.py``);
- an output gate (a projection of the hidden state multiplying the heads' output before the exit):
  column parallel like q, k and v.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_parallel.plans.detect import (
    NORM_NAME,
    ContainerCandidate,
    head_count,
    head_dim_of,
    join,
    kv_head_count,
    norms_in,
)
from lightning_parallel.tensor_parallel.latent_styles import LatentMaker, LatentReader
from lightning_parallel.tensor_parallel.norm_styles import GatheredNorm, HeadShardedNorm
from lightning_parallel.tensor_parallel.param_styles import LocalParameters
from lightning_parallel.tensor_parallel.plan import EntryVariant, ShardedContainer
from lightning_parallel.tensor_parallel.row_layout import RowLayout
from lightning_parallel.tensor_parallel.styles import ColwiseProjection, is_projection, projection_dims


class UnsupportedLayout(ValueError):
    """A module whose layout the automatic plan does not know how to split: left replicated, with a note."""


def require_divisible(value: int, tp: int, what: str, module: str) -> None:
    if value % tp != 0:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"`tensor_parallel={tp}` does not divide the {value} {what} of `{module}`."
            f" Choose tensor_parallel among {divisors}, or exclude the module with `plan=`."
        )


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """K/V heads a rank holds: its share, or one when there are fewer than ranks (each shared by ``tp / kv_heads``)."""
    return max(kv_heads // tp, 1)


def latent_makers(entries: list[tuple[str, nn.Module]], hidden: int) -> dict[str, str]:
    """Multi-head latent attention: ``{reader: maker}`` for each projection reading a low-rank latent (not the
    hidden state), the maker being a projection of the hidden state whose output can hold that latent
    (``kv_a_proj_with_mqa`` makes ``kv_b_proj``'s latent plus the shared rotary key): of those, the one whose
    name shares the longest start with the reader's (``q_b_proj`` reads ``q_a_proj``, ``kv_b_proj`` reads
    ``kv_a_proj_with_mqa``, whatever their widths: Dots3's q and kv latents are equally wide), then the
    narrowest."""
    readers = [(n, m) for n, m in entries if projection_dims(m)[0] != hidden]
    makers = [(n, m) for n, m in entries if projection_dims(m)[0] == hidden]
    found = {}
    for name, reader in readers:
        width = projection_dims(reader)[0]
        fitting = [(projection_dims(m)[1], n) for n, m in makers if projection_dims(m)[1] >= width]
        if not fitting:
            raise UnsupportedLayout(
                f"`{name}` reads {width} features, neither the {hidden}-wide hidden state nor a latent another"
                " projection of the attention makes"
            )
        found[name] = min(fitting, key=lambda f: (-len(os.path.commonprefix([f[1], name])), f))[1]
    return found


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
    - ``G groups of q|k|v``: G groups of three equal parts, cut by a constant of the model's code whatever
      the local width (CodeGen's ``mp_num``): each rank stores its heads' rows in that many groups;
    - ``q|k|v blocks``: a block of query rows, then fewer key and value rows (Phi-3's ``qkv_proj``;
      GPT-BigCode's multi-query ``c_attn``): each rank stores its query heads and the k/v heads they use,
      in another row order than the user's (``tensor_parallel/row_layout.py``); with fewer k/v heads than
      ranks a k/v head is on several ranks.
    """
    if width == 3 * heads * head_dim and kv_heads == heads:
        grouped = [
            (
                f"{groups} groups of q|k|v",
                RowLayout.of_groups(width, groups, 3, tp, label=f"{groups} groups of q|k|v"),
            )
            for groups in range(2, heads + 1)
            if heads % groups == 0 and (heads * head_dim // groups) % tp == 0
        ]
        return [
            ("q|k|v", ColwiseProjection(num_chunks=3, use_local_output=True)),
            ("per head", ColwiseProjection(use_local_output=True)),
            *[(label, ColwiseProjection(row_layout=rows, use_local_output=True)) for label, rows in grouped],
        ]
    if width == (heads + 2 * kv_heads) * head_dim:
        blocks = [(heads * head_dim, heads), (kv_heads * head_dim, kv_heads), (kv_heads * head_dim, kv_heads)]
        rows = RowLayout.of_blocks(blocks, tp, label="q|k|v blocks")
        layouts = [("q|k|v blocks", ColwiseProjection(row_layout=rows, use_local_output=True))]
        if kv_heads % tp == 0:
            layouts.insert(0, ("per k/v group", ColwiseProjection(use_local_output=True)))
        return layouts
    raise UnsupportedLayout(
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
    - a whole projection's width (``widths``: OLMo 2's, OLMoE's; BitNet's norm of the heads' output before
      the exit): its statistics span heads other ranks hold; the input is gathered and the norm runs whole.
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


def own_tensor_styles(
    module: nn.Module,
    full_name: str,
    sharded: dict[int, str],
    *,
    returned_whole: bool = False,
    buffers: bool = True,
) -> dict:
    """``LocalParameters`` for the module's own parameters and buffers (not its children's): cut along the
    first dimension whose size ``sharded`` names (the heads; an MLP's hidden units), else kept whole with a
    summed gradient; buffers without such a dimension are left alone (``buffers=False``: all of them)."""
    dims: dict[str, int | None] = {}
    own_buffers = list(module.named_buffers(recurse=False)) if buffers else []
    for name, tensor in [*module.named_parameters(recurse=False), *own_buffers]:
        if tensor is None or tensor.dim() == 0 and name in module._buffers:
            continue
        along = next((d for d, size in enumerate(tensor.shape) if size in sharded and size > 1), None)
        if along is None and name in module._buffers:
            continue
        dims[name] = along
    return {full_name: LocalParameters(dims, returned_whole=returned_whole)} if dims else {}


def helper_styles(container: nn.Module, full_name: str, sharded: dict[int, str], handled: set[str]) -> dict:
    """Children of a container with weights that are neither projections nor norms with a style (a learnable
    activation's scalars, xIELU; a relative-position table): their parameters as :func:`own_tensor_styles`
    says. Their buffers stay whole: a child's constants (a rotary embedding's frequencies, whose count may
    equal the heads' by chance: RecurrentGemma's 4) are not per head; per-head constants of an attention
    (MiniMax's decay rates) are its own, cut above."""
    styles: dict = {}
    for name, child in container.named_modules():
        if not name or is_projection(child) or join(full_name, name) in handled:
            continue
        if any(name.startswith(h + ".") for h in handled if h):
            continue
        if NORM_NAME.search(type(child).__name__) or isinstance(child, (nn.LayerNorm, nn.RMSNorm)):
            continue
        styles.update(own_tensor_styles(child, join(full_name, name), sharded, buffers=False))
    return styles


def choose_exit(cand: ContainerCandidate, hidden: int | None) -> tuple[str, nn.Module]:
    """The projection that writes the attention's output: of those writing the model width that every other
    projection could follow, the one named as an output (``o_proj``, ``out_proj``, ``dense``, ``c_proj``),
    else the last registered (an output gate, ``gate_proj``, may be registered after ``o_proj``)."""

    fitting = [
        (n, m) for n, m in cand.projections if hidden is None or projection_dims(m)[1] == hidden
    ] or cand.projections
    named = [(n, m) for n, m in fitting if re.search(r"(^|_)(o|out|output|dense|c_proj|wo)(_proj)?$", n)]
    if named:
        return named[-1]
    return cand.exit


def heads_of(full_name: str, module: nn.Module, exit_in: int) -> tuple[int, int]:
    heads = head_count(module)
    head_dim = head_dim_of(module)
    if heads is None and head_dim:
        heads = exit_in // head_dim
    if heads is None:
        raise UnsupportedLayout(
            f"no attribute such as `n_head`, `num_heads` or `head_dim` gives the number of heads of `{full_name}`"
            f" ({type(module).__name__})"
        )
    return heads, head_dim or exit_in // heads


def plan_attention_entries(
    full_name: str, cand: ContainerCandidate, exit_name: str, tp: int, hidden: int, heads: int, head_dim: int
) -> tuple[dict, list, int, set[str]]:
    """Styles of the entries, the fused variants, the k/v heads, and the latent makers left whole."""
    module = cand.module
    entries = [(n, m) for n, m in cand.projections if n != exit_name]
    kv_heads = kv_head_count(module)
    plain = [(n, m) for n, m in entries if projection_dims(m)[0] == hidden]
    makers = set(latent_makers(entries, hidden).values())
    if kv_heads is None and len(plain) == 3 and not makers:
        kv_heads = projection_dims(plain[1][1])[1] // head_dim  # from the key projection's width
    if kv_heads is None and len(plain) == 1:  # a fused q|k|v: its width tells (multi-query GPT-BigCode)
        fused = projection_dims(plain[0][1])[1] // head_dim - heads
        kv_heads = fused // 2 if fused > 0 and fused % 2 == 0 and fused // 2 != heads else None
    kv_heads = kv_heads or heads
    require_divisible(heads, tp, "attention heads", full_name)
    if not makers and (kv_heads >= tp or tp % kv_heads):
        require_divisible(kv_heads, tp, "key/value heads", full_name)
    exit_in = projection_dims(module.get_submodule(exit_name))[0]
    kv_width = kv_heads * head_dim
    styles: dict = {}
    variants: list[EntryVariant] = []
    for name, entry in entries:
        entry_out = projection_dims(entry)[1]
        if name in makers:  # the latent is made whole on every rank, its gradient summed once
            styles[join(full_name, name)] = LatentMaker()
            continue
        if makers and projection_dims(entry)[0] != hidden:  # reads the latent: keeps its gradient's share
            styles[join(full_name, name)] = LatentReader(use_local_output=True)
            continue
        if entry_out % tp:
            require_divisible(entry_out, tp, "outputs", join(full_name, name))
        if len(plain) == 1 and not makers and entry_out != exit_in:  # a fused projection: by verification
            layouts = fused_layouts(join(full_name, name), entry_out, heads, kv_heads, head_dim, tp)
            variants = [EntryVariant(label, {join(full_name, name): style}) for label, style in layouts]
            styles.update(variants[0].styles)
        elif entry_out in (heads, kv_heads) and projection_dims(entry)[0] == kv_width and kv_width % tp == 0:
            # one output per head from the heads' values (Doge's dt_proj); it may read as wide as the hidden state
            styles[join(full_name, name)] = ColwiseProjection(
                use_local_output=True, sliced_input_width=kv_width // tp
            )
        elif not makers and kv_heads < tp and entry_out == kv_width and kv_width != exit_in:
            layout = RowLayout.of_blocks(
                [(kv_width, kv_heads)], tp, label=f"{kv_heads} k/v heads, each on {tp // kv_heads} ranks"
            )
            styles[join(full_name, name)] = ColwiseProjection(row_layout=layout, use_local_output=True)
        else:
            styles[join(full_name, name)] = ColwiseProjection(use_local_output=True)
    return styles, variants, kv_heads, makers


def paired_heads_styles(
    full_name: str,
    cand: ContainerCandidate,
    exit_name: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tp: int,
) -> tuple[dict, int] | None:
    """Separate q, k and v whose heads the model's code pairs across halves (differential attention: head
    ``i`` with head ``i + heads / 2``, the values cut in two halves likewise): each rank stores its block of
    each half, so the same code pairs the same heads on the rank's local tensors. The entries' styles and the
    k/v heads a rank holds; None where the heads cannot be so split."""
    entries = [(n, m) for n, m in cand.projections if n != exit_name]
    plain = [(n, m) for n, m in entries if projection_dims(m)[0] == hidden]
    half_kv = kv_heads // 2
    if len(plain) != len(entries) or len(plain) != 3 or heads % (2 * tp) or kv_heads % 2:
        return None
    if half_kv % tp and tp % half_kv:
        return None
    styles = {}
    for name, entry in plain:
        count = heads if projection_dims(entry)[1] == heads * head_dim else kv_heads
        half = count // 2 * head_dim
        rows = RowLayout.of_blocks(
            [(half, count // 2), (half, count // 2)], tp, label="heads paired across halves"
        )
        styles[join(full_name, name)] = ColwiseProjection(row_layout=rows, use_local_output=True)
    return styles, 2 * max(half_kv // tp, 1)


def make_container(
    full_name: str, cand: ContainerCandidate, exit_name: str, makers: set[str], hidden: int, heads: int, **kw
) -> ShardedContainer:
    entries = [n for n, m in cand.projections if n != exit_name and n not in makers]
    reading_hidden = [n for n in entries if projection_dims(cand.module.get_submodule(n))[0] == hidden]
    return ShardedContainer(
        name=full_name,
        kind="attention",
        entries=[join(full_name, n) for n in reading_hidden],
        exit=join(full_name, exit_name),
        hidden_size=hidden,
        heads=heads,
        **kw,
    )
