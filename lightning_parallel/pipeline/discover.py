"""Learn, from one real training step on the whole model, how to cut it into stages.

Only the user's own ``training_step`` knows how the model is called and where the loss is,
so we run it once on a real batch (before anything is sharded) and watch:

- the blocks: each must be called exactly once, in order (otherwise the step cannot be cut
  at block boundaries), and where their hidden-state argument is;
- which parameters outside the blocks feed the *first* block (embeddings: stage 0) and which
  feed the loss *after* the last block (final norm, head: last stage). Autograd answers this
  exactly, including weights used directly (``x @ self.wte.weight.T``) and weights tied
  between the two ends (GPT's embedding and head), which then live on both end stages;
- which parameters outside the blocks reach a block through its *other* arguments (a learned
  relative-position bias or per-layer embeddings made once at model level and handed to every
  block): they live on every stage whose blocks read them, each stage computes them as the
  one-process model does, and their gradients are summed over those stages like a tied weight's;
- whether a block's other arguments carry what an earlier block computed (a tensor derived from its
  weights, state it returned besides the hidden state or wrote into a container every block receives:
  keys and values shared across layers, ``handed_state.py``): each makes a pair of blocks no stage
  boundary may separate (a cut between them would hand the later stage nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_parallel.compat import tree_map_only
from lightning_parallel.pipeline.handed_state import HandedState
from lightning_parallel.tensor_parallel.regions import find_hidden


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
    # canonical names feeding the loss after the blocks
    post_parameters: set[str] = field(default_factory=set)
    other_parameters: set[str] = field(default_factory=set)  # outside the blocks, unused by the step
    # block index -> canonical names reaching it through its arguments other than the hidden state
    side_parameters: dict[int, set[str]] = field(default_factory=dict)
    # (earlier block, later block) -> the later one's argument carrying state between them (handed_state.py)
    handed: dict[tuple[int, int], str] = field(default_factory=dict)


class DiscoveryProbe:
    """Watches one run of the user's step (see :class:`~lightning_parallel.parallelize.sample.SampledStep`).

    ``attach`` hooks the blocks, ``finish(output)`` classifies every parameter outside the
    blocks from the step's output, ``detach`` removes the hooks; :func:`discover` runs all three
    around a step. A probe, so that the one sampled step at setup can serve the plan
    verification at the same time.

    ``training=False`` (``trainer.validate/test/predict`` without ``fit``): an evaluation step
    need not return a loss, so every parameter outside the blocks is also kept on the last
    stage (more memory there, never a missing weight).
    """

    needs_grad = True

    def __init__(self, module: nn.Module, block_names: list[str], *, training: bool = True) -> None:
        self.module, self.block_names, self.training = module, list(block_names), training
        self.blocks = [module.get_submodule(name) for name in block_names]
        block_param_ids = {id(p) for block in self.blocks for p in block.parameters()}
        self.outside = [p for _, p in module.named_parameters() if id(p) not in block_param_ids]
        self.calls: list[int] = []
        self.seen: dict[str, Any] = {}
        # block index -> its other differentiable arguments
        self.side_inputs: dict[int, list[torch.Tensor]] = {}
        # integers a block returns for the next one, containers a block writes into
        self.handed = HandedState()
        self.result: Discovery | None = None
        self._handles: list[Any] = []
        self._frozen: list[nn.Parameter] = []

    def _pre_hook(self, index: int) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.calls.append(index)
            hidden = find_hidden(args, kwargs)[1]
            if index == 0 and "first_input" not in self.seen:
                self.seen["first_input"] = hidden
            if index not in self.side_inputs:
                self.side_inputs[index] = _other_tensors((args, kwargs), hidden)
            self.handed.entering(index, _named(args, kwargs), hidden)

        return hook

    def _post_hook(self, index: int) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
            self.handed.leaving(index, _named(args, kwargs), output, OutputTemplate.hidden_of(output))
            template = self.seen.setdefault("template", OutputTemplate.of(output))
            if index != len(self.blocks) - 1:
                return None
            # Cut the graph after the last block: gradients that still reach parameters outside
            # the blocks come from code after the blocks (final norm, head, loss).
            hidden = OutputTemplate.hidden_of(output).detach().requires_grad_()
            return template.build(hidden) if template.kind != "tensor" else hidden

        return hook

    def attach(self) -> None:
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post_hook(index), with_kwargs=True))
        self._frozen = [p for p in self.module.parameters() if not p.requires_grad]
        for p in self._frozen:  # classify frozen weights too (transfer learning): they still need a home
            p.requires_grad_(True)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.handed.clear()
        for p in self._frozen:
            p.requires_grad_(False)
        self._frozen = []

    def finish(self, output: Any) -> None:
        """Classify the parameters outside the blocks (autograd must be on: the step ran with grad)."""
        loss = extract_loss(output) if self.training else None
        calls, names = self.calls, self.block_names
        if calls != list(range(len(self.blocks))):
            raise PipelineSetupError(
                f"During one training step the blocks {names[0]}..{names[-1]} were called in the"
                f" order {calls[:12]}{'...' if len(calls) > 12 else ''}, not once each in order. {SUPPORTED_STEP}"
            )
        outside = self.outside
        post = _reached(loss, outside) if loss is not None else [True] * len(outside)
        first_input = self.seen["first_input"]
        pre = _reached(first_input.sum(), outside) if first_input.requires_grad else [False] * len(outside)
        result = Discovery(
            block_names=list(names),
            block_costs=[sum(p.numel() for p in block.parameters()) for block in self.blocks],
            template=self.seen["template"],
        )
        param_names = {id(p): n for n, p in self.module.named_parameters()}
        side = self._side_parameters()
        for param, is_pre, is_post in zip(outside, pre, post, strict=True):
            name = param_names[id(param)]
            if is_pre:
                result.pre_parameters.add(name)
            if is_post:
                result.post_parameters.add(name)
            if not (is_pre or is_post or any(name in names for names in side.values())):
                result.other_parameters.add(name)
        result.side_parameters = side
        result.handed = dict(self.handed.pairs)
        self.result = result

    def _side_parameters(self) -> dict[int, set[str]]:
        """Per block, the parameters outside the blocks its other arguments depend on. Where those arguments
        depend on an earlier block's weights (state one block hands a later one), the latest such block and
        this one make a pair the stage split keeps together (``handed_state.py``)."""
        param_names = {id(p): n for n, p in self.module.named_parameters()}
        out: dict[int, set[str]] = {}
        for index, tensors in sorted(self.side_inputs.items()):
            if not tensors:
                continue
            total = sum(t.float().sum() for t in tensors)
            # What a block stored or returned is followed exactly (handed_state.py); other tensors made from an
            # earlier block's weights pair with the latest such block (the earlier ones reach it through the
            # hidden state, which the stages pass on). A write into a plain tensor the model made (no container,
            # no graph: ``buffer.copy_(x.detach())``) is not seen.
            made = [t for t in tensors if not self.handed.is_candidate(t)]
            owners = [(b, p) for b, block in enumerate(self.blocks[:index]) for p in block.parameters()]
            hits = _reached(sum(t.float().sum() for t in made), [p for _, p in owners]) if made else []
            latest = max((b for (b, _), hit in zip(owners, hits, strict=False) if hit), default=None)
            if latest is not None:
                self.handed.pairs.setdefault((latest, index), WEIGHTS)
            reached = _reached(total, self.outside)
            names = {param_names[id(p)] for p, hit in zip(self.outside, reached, strict=True) if hit}
            if names:
                out[index] = names
        return out


def discover(
    module: nn.Module, block_names: list[str], step: Callable[[], Any], *, training: bool = True
) -> Discovery:
    """Run ``step`` once on the full model and classify every parameter outside the blocks."""
    probe = DiscoveryProbe(module, block_names, training=training)
    probe.attach()
    try:
        with torch.enable_grad():
            probe.finish(step())
    finally:
        probe.detach()
    assert probe.result is not None
    return probe.result


WEIGHTS = ""
"""The argument recorded for a pair found through autograd: a tensor computed from the earlier block's weights."""


def handed_on(block: str, what: str) -> str:
    return (
        f"Block {block} receives, besides the hidden state, {what} (keys and values shared across layers,"
        " or another state one layer hands a later one). Pipeline stages pass on only the hidden state, so a"
        " cut between them would lose it. Use pipeline_parallel=1 for this model (tensor, expert and data"
        " parallelism and ZeRO apply)."
    )


def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**{f"positional argument {i}": a for i, a in enumerate(args)}, **kwargs}


def _other_tensors(arguments: Any, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The differentiable tensors among a block's arguments, the hidden state aside (also inside
    containers: a dict of per-layer states, a cache object's lists are not searched)."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t is not hidden and t.requires_grad and t.is_floating_point():
            found.append(t)
        return t

    tree_map_only(torch.Tensor, keep, arguments)
    return found


def _reached(output: torch.Tensor, params: list[nn.Parameter]) -> list[bool]:
    if not params or not output.requires_grad:
        return [False] * len(params)
    grads = torch.autograd.grad(output, params, allow_unused=True, retain_graph=True)
    return [g is not None for g in grads]
