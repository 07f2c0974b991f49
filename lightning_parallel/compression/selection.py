"""Which modules compression touches by default: every linear layer but the language model's output head.

The head is found as the tensor-parallel plan finds it (``plans.detect``: the projection onto the
token embedding's vocabulary), so pruning, quantisation and distillation agree with the plan on
what "the head" is. A weight tied to an embedding is never selected either: changing it would
change the embedding (under pipeline parallelism a stage may hold the tied copy without the head's
detection succeeding there).
"""

from __future__ import annotations

from torch import nn

from lightning_parallel.plans.detect import find_block_stack, find_output_head, find_token_embedding

__all__ = ["body_linears", "head_and_embedding"]


def head_and_embedding(module: nn.Module) -> tuple[str, str] | None:
    """``(head, token embedding)`` names, or None when the module has no such pair."""
    stack = find_block_stack(module)  # outside the blocks: an MLP may widen to the vocabulary's size
    outside = stack.name if stack is not None else None
    embedding = find_token_embedding(module, outside)
    if embedding is None:
        return None
    head = find_output_head(module, embedding[1].num_embeddings, outside)
    return (head[0], embedding[0]) if head is not None else None


def body_linears(module: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules but the output head and any whose weight is an embedding's."""
    found = head_and_embedding(module)
    head = found[0] if found else None
    tied = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and name != head and id(m.weight) not in tied
    ]
