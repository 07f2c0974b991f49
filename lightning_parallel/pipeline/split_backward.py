"""Stages whose weight gradients torch 2.11's split backward gets wrong, refused before that backward runs.

The zero-bubble schedules (``interleaved_zero_bubble``, ``zbv``, ``dualpipev``) split a stage's backward
into an input pass and a later weight pass (torch's ``stage_backward_input`` / ``stage_backward_weight``).
The input pass groups the weights by the nodes where their paths meet the activations' ("intermediates")
and keeps the gradients reaching those nodes; torch 2.11's weight pass then hands each node the sum of
its gradients on its first output and starts from every intermediate of a group at once. Two ways that is
wrong, silently: a group with more than one intermediate where one lies below another (a parameter used
twice along a path: a block applied twice, ALBERT-style; a weight whose one bf16 copy autocast caches and
two layers use; a transposed weight used twice), whose lower gradient is then counted twice; and an
intermediate with several outputs (an LSTM whose output and states are used). Measured on torch 2.11
against the full backward: 4.5 off on a matrix used twice, 1.9 on a linear applied twice under bf16
autocast, 0.9 on an LSTM's states; torch 2.13 hands each output its own gradient and stops the double
count, exact in every case. The first stage runs a full backward for its weight pass and is exact too.

So on a torch older than 2.13, each later stage's first split backward builds torch's own groups from its
graph and refuses a group with more than one intermediate or an intermediate with several outputs (a group
of two intermediates on parallel branches is exact, and refused as well: the cheap test cannot tell).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from lightning_parallel.compat import pipeline_weight_groups, split_weight_backward_exact

__all__ = ["check_split_backward", "weights_the_split_backward_gets_wrong"]


def weights_the_split_backward_gets_wrong(
    outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor], module: nn.Module
) -> list[str]:
    """The weights of the graph behind ``outputs`` that torch 2.11's weight pass would get wrong, by name.

    The weights are the graph's own leaves, not ``module.parameters()``: under FSDP2 they are the gathered
    parameters, which the module does not list between forward and backward.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    groups = pipeline_weight_groups(
        [t for t in outputs if isinstance(t, torch.Tensor)],
        [t for t in inputs if isinstance(t, torch.Tensor)],
    )
    wrong = []
    for weights, intermediate_outputs in groups:
        if len(intermediate_outputs) > 1 or any(count > 1 for count in intermediate_outputs):
            wrong += [names.get(id(w), f"a {tuple(w.shape)} parameter") for w in weights]
    return sorted(set(wrong))


def check_split_backward(
    outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor], module: nn.Module, stage_index: int
) -> None:
    """Raise where torch's split weight pass would compute wrong gradients for this stage (torch < 2.13).

    Raised on this stage's rank in the middle of the schedule: the other ranks end at the process group's
    timeout (the strategy's ``timeout``), as for any rank lost mid-step.
    """
    if split_weight_backward_exact() or stage_index == 0:
        return
    try:
        wrong = weights_the_split_backward_gets_wrong(outputs, inputs, module)
    except Exception as error:  # noqa: BLE001 - torch's own grouping failed here: its split would fail alike
        warnings.warn(f"Stage {stage_index}: the split-backward check could not run ({error}).", stacklevel=2)
        return
    if wrong:
        raise ValueError(
            "The zero-bubble `pipeline_schedule`s split each stage's backward into an input and a weight pass; on torch"
            f" {torch.__version__} that weight pass computes wrong gradients where a weight meets the activations at"
            f" several nodes of one path (a block or a weight used twice) or at a node with several outputs, and"
            f" stage {stage_index} has {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''} so (fixed in torch"
            " 2.13). Use torch>=2.13, or a schedule without the split: 'interleaved_1f1b' or '1f1b'."
        )
