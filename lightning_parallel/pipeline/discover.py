"""Learn, from one real training step on the whole model, how to cut it into stages.

Only the user's own ``training_step`` knows how the model is called and where the loss is,
so we run it once on a real batch (before anything is sharded) and watch:

- the blocks: each must be called exactly once, in order (otherwise the step cannot be cut
  at block boundaries), and where their hidden-state argument is;
- which parameters outside the blocks feed the *first* block (embeddings: stage 0) and which
  feed the loss *after* the last block (final norm, head: last stage). Autograd answers this
  exactly, including weights used directly (``x @ self.wte.weight.T``) and weights tied
  between the two ends (GPT's embedding and head), which then live on both end stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_parallel.tensor_parallel.regions import _find_hidden


class PipelineSetupError(ValueError):
    """The training step cannot be pipelined as written; the message says what to change."""


SUPPORTED_STEP = (
    "Pipeline parallelism runs your training_step once per micro-batch on every stage. It must"
    " call the model's forward once, through the repeated block list (each block once, in order),"
    " and return the loss (a scalar tensor, or a dict with a 'loss' entry) averaged over the"
    " samples of its batch."
)


def extract_loss(output: Any) -> torch.Tensor:
    """The loss from a ``training_step`` return value, as Lightning reads it."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PipelineSetupError(
            f"training_step returned {type(output).__name__}, not a scalar loss tensor. {SUPPORTED_STEP}"
        )
    return loss.reshape(())


@dataclass
class OutputTemplate:
    """How a block returns the hidden state: as the tensor itself, or first in a tuple/list."""

    kind: str  # "tensor" | "tuple" | "list"
    rest: tuple[Any, ...] = ()  # the other elements (tensors among them are replaced by None)

    @classmethod
    def of(cls, output: Any) -> OutputTemplate:
        if isinstance(output, torch.Tensor):
            return cls("tensor")
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            rest = tuple(None if isinstance(x, torch.Tensor) else x for x in output[1:])
            return cls("list" if isinstance(output, list) else "tuple", rest)
        raise PipelineSetupError(
            f"A transformer block returned {type(output).__name__}; pipeline stages exchange the hidden"
            " state, so a block must return a tensor or a tuple whose first element is the hidden state."
        )

    def build(self, hidden: torch.Tensor) -> Any:
        if self.kind == "tensor":
            return hidden
        items = (hidden, *self.rest)
        return list(items) if self.kind == "list" else items

    @staticmethod
    def hidden_of(output: Any) -> torch.Tensor:
        return output if isinstance(output, torch.Tensor) else output[0]


@dataclass
class Discovery:
    """What one real step showed; identical on every rank (same weights, same batch)."""

    block_names: list[str]
    block_costs: list[int]
    template: OutputTemplate
    pre_parameters: set[str] = field(default_factory=set)  # canonical names feeding the first block
    post_parameters: set[str] = field(
        default_factory=set
    )  # canonical names feeding the loss after the blocks
    other_parameters: set[str] = field(default_factory=set)  # outside the blocks, unused by the step


def discover(
    module: nn.Module, block_names: list[str], step: Callable[[], Any], training: bool = True
) -> Discovery:
    """Run ``step`` once on the full model and classify every parameter outside the blocks.

    ``training=False`` (``trainer.validate/test/predict`` without ``fit``): an evaluation step
    need not return a loss, so every parameter outside the blocks is also kept on the last
    stage (more memory there, never a missing weight).
    """
    blocks = [module.get_submodule(name) for name in block_names]
    block_param_ids = {id(p) for block in blocks for p in block.parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    outside = [p for n, p in module.named_parameters() if id(p) not in block_param_ids]

    calls: list[int] = []
    seen: dict[str, Any] = {}

    def pre_hook(index: int) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append(index)
            if index == 0 and "first_input" not in seen:
                seen["first_input"] = _find_hidden(args, kwargs)[1]

        return hook

    def post_hook(index: int) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: Any, output: Any) -> Any:
            seen.setdefault("template", OutputTemplate.of(output))
            if index != len(blocks) - 1:
                return None
            # Cut the graph after the last block: gradients that still reach parameters outside
            # the blocks come from code after the blocks (final norm, head, loss).
            hidden = OutputTemplate.hidden_of(output).detach().requires_grad_()
            return seen["template"].build(hidden) if seen["template"].kind != "tensor" else hidden

        return hook

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre_hook(index), with_kwargs=True))
        handles.append(block.register_forward_hook(post_hook(index)))
    frozen = [p for p in module.parameters() if not p.requires_grad]
    for p in frozen:  # classify frozen weights too (transfer learning): they still need a home
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            output = step()
            loss = extract_loss(output) if training else None
        if calls != list(range(len(blocks))):
            raise PipelineSetupError(
                f"During one training step the blocks {block_names[0]}..{block_names[-1]} were called in the"
                f" order {calls[:12]}{'...' if len(calls) > 12 else ''}, not once each in order. {SUPPORTED_STEP}"
            )
        post = _reached(loss, outside) if loss is not None else [True] * len(outside)
        first_input = seen["first_input"]
        pre = _reached(first_input.sum(), outside) if first_input.requires_grad else [False] * len(outside)
    finally:
        for handle in handles:
            handle.remove()
        for p in frozen:
            p.requires_grad_(False)
    result = Discovery(
        block_names=list(block_names),
        block_costs=[sum(p.numel() for p in block.parameters()) for block in blocks],
        template=seen["template"],
    )
    for param, is_pre, is_post in zip(outside, pre, post, strict=True):
        name = names[id(param)]
        if is_pre:
            result.pre_parameters.add(name)
        if is_post:
            result.post_parameters.add(name)
        if not (is_pre or is_post):
            result.other_parameters.add(name)
    return result


def _reached(output: torch.Tensor, params: list[nn.Parameter]) -> list[bool]:
    if not params or not output.requires_grad:
        return [False] * len(params)
    grads = torch.autograd.grad(output, params, allow_unused=True, retain_graph=True)
    return [g is not None for g in grads]
