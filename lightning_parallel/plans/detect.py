"""Structural discovery on an unmodified ``nn.Module``: the block stack, embeddings, head, and
the attention/MLP containers inside a block.

Nothing here depends on class names of a particular library: a container is any module that
owns two or more projections (``nn.Linear`` or Hugging Face ``Conv1D``) as direct children;
the last registered one is its exit, the others its entries (true of q/k/v/o, c_attn/c_proj,
gate/up/down, fc/proj in every model we know). Wrong guesses are caught by the block
verification at setup, so a heuristic can fail loudly but never silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from lightning_parallel.tensor_parallel.styles import is_projection, projection_dims

HEAD_COUNT_ATTRS = re.compile(
    r"^(n_head|n_heads|num_heads|num_attention_heads|nheads|n_heads_q|num_q_heads)$"
)
KV_HEAD_COUNT_ATTRS = re.compile(r"^(n_kv_head|n_kv_heads|num_kv_heads|num_key_value_heads|n_head_kv)$")
KV_GROUP_ATTRS = re.compile(r"^(num_key_value_groups|n_rep|num_queries_per_kv)$")  # query heads per k/v head
HEAD_DIM_ATTRS = ("head_dim", "head_size", "d_head", "attention_head_size")
WIDTH_ATTRS = re.compile(
    r"^(n_embd|embed_dim|hidden_size|split_size|all_head_size|d_model|dim|inner_dim|n_state|q_width|kv_width)$"
)
ATTENTION_NAME = re.compile(r"attn|attention", re.IGNORECASE)
NORM_NAME = re.compile(r"norm", re.IGNORECASE)


@dataclass
class BlockStack:
    """The repeated layer list of a model: ``name`` is its path in the model."""

    name: str
    blocks: nn.ModuleList

    @property
    def names(self) -> list[str]:
        """The blocks' own paths in the model, in forward order (``transformer.h.0``, ...)."""
        return [join(self.name, str(i)) for i in range(len(self.blocks))]


@dataclass
class ContainerCandidate:
    """A module with >= 2 direct projection children (attention or MLP)."""

    name: str  # relative to the block
    module: nn.Module
    projections: list[tuple[str, nn.Module]]  # (child name, module) in registration order

    @property
    def exit(self) -> tuple[str, nn.Module]:
        """The projection that writes the container's output: the last registered one whose output width is
        what every other projection reads (Phi-3 registers ``o_proj`` before ``qkv_proj``); the last
        registered one if none is."""
        for name, module in reversed(self.projections):
            width = projection_dims(module)[1]
            if all(projection_dims(m)[0] == width for n, m in self.projections if n != name):
                return name, module
        return self.projections[-1]

    @property
    def entries(self) -> list[tuple[str, nn.Module]]:
        exit_name = self.exit[0]
        return [(n, m) for n, m in self.projections if n != exit_name]

    def looks_like_attention(self) -> bool:
        if ATTENTION_NAME.search(type(self.module).__name__) or ATTENTION_NAME.search(
            self.name.split(".")[-1]
        ):
            return True
        # Own attributes only: a Hugging Face MLP shares the model config, heads included.
        return _int_attr(self.module, HEAD_COUNT_ATTRS) is not None


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The repeated layer list: the ``ModuleList`` of same-class children holding most parameters; failing
    that, a hybrid stack (Jamba's attention and Mamba layers, Zamba's): the ``ModuleList`` of several layer
    classes holding most parameters, when it holds most of the model's (each of its layers still takes and
    returns the hidden state: the pipeline's discovery checks that every one is called once, in order)."""
    best: BlockStack | None = None
    hybrid: BlockStack | None = None
    best_size = hybrid_size = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        size = _numel(module)
        if len({type(child) for child in module}) == 1:
            if size > best_size:
                best, best_size = BlockStack(name, module), size
        elif len(module) >= 2 and size > hybrid_size:
            hybrid, hybrid_size = BlockStack(name, module), size
    if hybrid is not None and hybrid_size > max(best_size, _numel(model) / 2):
        return hybrid
    return best


def block_names(model: nn.Module) -> list[str]:
    """The paths of the repeated blocks, in forward order; empty when the model has no block list.

    The one block lister: tensor-parallel plans, the pipeline cut, activation checkpointing and
    ``compile`` all mean these blocks.
    """
    stack = find_block_stack(model)
    return stack.names if stack is not None else []


def wrapped_projection(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The one projection a module wraps and holds nothing else of (Moshi's ``MoshiLinear`` around its
    ``linear``): ``(its name inside, it)``; None for anything else."""
    holders = [
        (n, m) for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))
    ]
    if (
        len(holders) == 1
        and is_projection(holders[0][1])
        and not any(True for _ in module.parameters(recurse=False))
    ):
        return holders[0]
    return None


def gated_pair(module: nn.Module, exit_in: int, exit_out: int) -> list[tuple[str, nn.Module]] | None:
    """A gate and an up projection held by a child of an MLP beside the MLP's exit (CPM-Ant's ``w_in``
    holding ``w_0`` and ``w_1``): both read what the exit writes and write what it reads; no attention."""
    if any(True for _ in module.parameters(recurse=False)) or ATTENTION_NAME.search(type(module).__name__):
        return None
    children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
    holders = [m for n, m in module.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    if len(children) != 2 or len(holders) != 2 or not all(is_projection(c) for _, c in children):
        return None
    if any(projection_dims(c) != (exit_out, exit_in) for _, c in children):
        return None
    return children


def containers_in(block: nn.Module) -> list[ContainerCandidate]:
    """Modules with two or more projections as children, or as children's only content: wrappers (the
    projection is then named through them, ``q_proj.linear``), and a gate|up pair in a child beside the exit
    (``w_in.w_0``, ``w_in.w_1``; that child is then no container of its own)."""
    found = []
    absorbed: set[str] = set()
    for name, module in block.named_modules():
        if name in absorbed:
            continue
        projections = []
        pairs = []
        for child_name, child in module.named_children():
            inner = None if is_projection(child) else wrapped_projection(child)
            if is_projection(child):
                projections.append((child_name, child))
            elif inner is not None:
                projections.append((f"{child_name}.{inner[0]}", inner[1]))
            else:
                pairs.append((child_name, child))
        if len(projections) == 1:  # an exit beside a child holding the gate and up projections
            exit_in, exit_out = projection_dims(projections[0][1])
            for child_name, child in pairs:
                pair = gated_pair(child, exit_in, exit_out)
                if pair is not None:
                    projections[:0] = [(f"{child_name}.{n}", c) for n, c in pair]
                    absorbed.add(join(name, child_name))
                    break
        if len(projections) >= 2:
            found.append(ContainerCandidate(name, module, projections))
    return found


def norms_in(block: nn.Module, skip: set[str]) -> list[str]:
    """Normalisation layers of a block (outside the containers): replicated, sequence-parallel under SP."""
    names = []
    for name, module in block.named_modules():
        if not name or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        is_norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or NORM_NAME.search(type(module).__name__)
        if is_norm and any(True for _ in module.parameters(recurse=False)):
            names.append(name)
    return names


def sequence_mixer(module: nn.Module) -> str | None:
    """Why ``module`` mixes tokens otherwise than attention over heads (None: nothing says so).

    A convolution along the sequence is the mark of state-space layers (Mamba's ``conv1d``), linear
    attention (gated delta nets) and convolution blocks (LFM's ``ShortConv``): tensor parallelism leaves
    them whole, and sequence parallelism, which splits the sequence, cannot run them.
    """
    for name, child in module.named_modules():
        if isinstance(child, nn.Conv1d):
            return f"a token mixer with a convolution along the sequence, `{name or 'itself'}`"
    return None


def _int_attr(module: nn.Module, pattern: re.Pattern[str]) -> tuple[str, int] | None:
    for key, value in vars(module).items():
        if pattern.match(key) and isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def _config_int(module: nn.Module, pattern: re.Pattern[str]) -> int | None:
    """The same attribute on a Hugging Face-style ``module.config`` (read in ``__init__`` only)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    for key, value in vars(config).items():
        if pattern.match(key) and isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def head_count(module: nn.Module) -> int | None:
    found = _int_attr(module, HEAD_COUNT_ATTRS)
    return found[1] if found else _config_int(module, HEAD_COUNT_ATTRS)


def kv_head_count(module: nn.Module) -> int | None:
    found = _int_attr(module, KV_HEAD_COUNT_ATTRS)
    return found[1] if found else _config_int(module, KV_HEAD_COUNT_ATTRS)


def head_dim_of(module: nn.Module) -> int | None:
    for key in HEAD_DIM_ATTRS:
        value = getattr(module, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def find_token_embedding(model: nn.Module, exclude_prefix: str | None) -> tuple[str, nn.Embedding] | None:
    """The embedding with the largest vocabulary outside the block stack."""
    best = None
    for name, module in model.named_modules():
        if exclude_prefix and name.startswith(exclude_prefix + "."):
            continue
        if isinstance(module, nn.Embedding) and (
            best is None or module.num_embeddings > best[1].num_embeddings
        ):
            best = (name, module)
    return best


def find_output_head(
    model: nn.Module, vocab_size: int, exclude_prefix: str | None
) -> tuple[str, nn.Module] | None:
    """A projection outside the block stack that maps to the vocabulary."""
    for name, module in model.named_modules():
        if exclude_prefix and name.startswith(exclude_prefix + "."):
            continue
        if is_projection(module) and projection_dims(module)[1] == vocab_size:
            return name, module
    return None


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else (prefix or name)
