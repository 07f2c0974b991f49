"""Stages whose weight gradients torch 2.11's split backward gets wrong, refused before that backward runs.

The zero-bubble schedules (``interleaved_zero_bubble``, ``zbv``, ``dualpipev``) split a stage's backward
into an input pass and a later weight pass (torch's ``stage_backward_input`` / ``stage_backward_weight``).
torch 2.11's weight pass hands the gradients that reach a node where the parameters' paths meet the
activations' to that node as one sum; where a parameter is consumed by more than one node of the stage
(a block applied twice, ALBERT-style; a matrix used twice) some weights' gradients come out wrong,
silently: measured on torch 2.11 against the full backward, 4.5 on a matrix used twice, 0.79 on a
linear applied twice (torch 2.13 matches the full backward exactly; a weight used once, every model of
the test zoo, is exact on both). So on a torch older than 2.13, a stage's first split backward looks
for a parameter with more than one consumer in its graph, and refuses it with the ways out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_parallel.compat import split_weight_backward_exact

__all__ = ["check_split_backward", "parameters_used_more_than_once"]


def parameters_used_more_than_once(outputs: Iterable[torch.Tensor], module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that more than one node of the graph behind ``outputs`` consumes."""
    names = {id(p): name for name, p in module.named_parameters()}
    consumers: dict[int, set[int]] = {}
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    # Held, not just their ids: torch makes a node's Python object anew once the last one is gone (2.11 does,
    # here), and a freed object's id is given to the next, which would merge two consumers into one.
    seen: dict[int, object] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)  # AccumulateGrad: the leaf it accumulates into
            if variable is not None:
                if id(variable) in names:
                    consumers.setdefault(id(variable), set()).add(id(node))
            else:
                stack.append(child)
    return sorted(names[key] for key, nodes in consumers.items() if len(nodes) > 1)


def check_split_backward(outputs: Iterable[torch.Tensor], module: nn.Module, stage_index: int) -> None:
    """Raise where torch's split weight pass would compute wrong gradients for this stage (torch < 2.13)."""
    if split_weight_backward_exact():
        return
    used = parameters_used_more_than_once(outputs, module)
    if used:
        raise ValueError(
            "The zero-bubble `pipeline_schedule`s split each stage's backward into an input and a weight pass; on torch"
            f" {torch.__version__} that weight pass computes wrong gradients where a parameter is used more than once"
            f" in a stage, and stage {stage_index} uses {', '.join(used[:5])}{' ...' if len(used) > 5 else ''} more"
            " than once (fixed in torch 2.13). Use torch>=2.13, or a schedule without the split: 'interleaved_1f1b'"
            " or '1f1b'."
        )
