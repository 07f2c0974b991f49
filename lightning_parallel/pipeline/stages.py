"""Turn one rank's copy of the model into its pipeline stages, in place, without editing model code.

The user's forward runs unchanged on every stage, from its first line, once per micro-batch:

- blocks other ranks hold are replaced by :class:`SkippedBlock` (no parameters: the memory
  is freed); blocks this rank holds for *another* of its stages are passed through the same way;
- entering the stage's first block, the hidden state is replaced by the activation received
  from the previous stage; leaving its last block, :class:`StageExit` stops the forward and
  carries the hidden state out (the rest of the user's step never runs on that stage);
- parameters outside the blocks that this rank does not own (the embedding on later stages,
  the head on earlier ones) are replaced by zero tensors that take no memory
  (``torch.zeros(()).expand(shape)``), so code before the first block still runs; its result
  is discarded at the injection point, so the zeros never reach a gradient or a loss.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_parallel.pipeline.discover import Discovery, OutputTemplate
from lightning_parallel.tensor_parallel.regions import find_hidden, replace_hidden
from lightning_parallel.zero.tensor_parallel import registered_parameter


class StageExit(Exception):  # noqa: N818 - control flow, not an error
    """Raised leaving a stage's last block: the hidden state is the stage's output."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class SkippedBlock(nn.Module):
    """Stands in for a block held by another rank: returns the hidden state it was given.

    Model-level code may read a block's attributes while it loops over the blocks (Nemotron-H's
    ``layer.block_type``, RecurrentGemma's ``layer.temporal_block``, a layer's attention type): those reads
    answer from a copy of the block on the meta device (no memory; never registered, so its weights are not
    this module's)."""

    def __init__(self, name: str, template: OutputTemplate, block: nn.Module | None = None) -> None:
        super().__init__()
        self.held_elsewhere = name
        self.template = template
        if block is not None:
            self.__dict__["_lp_shadow"] = _meta_copy(block)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("_lp_shadow")
            if shadow is None or name.startswith("__"):
                raise
            return getattr(shadow, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.template.build(find_hidden(args, kwargs)[1])

    def extra_repr(self) -> str:
        return f"{self.held_elsewhere!r} runs on another pipeline stage"


def _meta_copy(block: nn.Module) -> nn.Module | None:
    """``block`` copied with every tensor it holds (weights, buffers, tensor attributes) on the meta device;
    None where a copy cannot be made (then attribute reads fail as they would have)."""
    memo: dict[int, Any] = {}
    for module in block.modules():
        held = [*module._parameters.values(), *module._buffers.values()]
        held += [v for v in module.__dict__.values() if isinstance(v, torch.Tensor)]
        for tensor in held:
            if tensor is not None and id(tensor) not in memo:
                meta = torch.empty_like(tensor, device="meta")
                memo[id(tensor)] = (
                    nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
                )
    try:
        return copy.deepcopy(block, memo)
    except (RuntimeError, TypeError):
        return None


@dataclass
class StageLayout:
    """Which blocks and parameters each stage holds; the same on every rank."""

    ranges: list[range]  # blocks of each stage, by global stage index
    owners: list[int]  # pipeline rank of each stage
    discovery: Discovery
    parameter_stages: dict[str, set[int]] = field(default_factory=dict)  # see :meth:`build`
    # canonical name of a weight several blocks share -> stage -> its name in that stage's first block using it
    aliases: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    def stage_of_block(self, block: int) -> int:
        return next(s for s, r in enumerate(self.ranges) if block in r)

    @classmethod
    def build(
        cls, module: nn.Module, ranges: list[range], owners: list[int], discovery: Discovery
    ) -> StageLayout:
        """Also record, before any surgery, which stages hold each parameter (canonical names).

        A module several blocks share (Zamba's shared transformer) lives on every stage whose blocks call
        it, as a tied embedding lives on both end stages: each stage's blocks add their part of its
        gradient, the parts are summed over those stages (``tied_across_ranks``), and every copy takes the
        same update. On a stage whose blocks reach it under another name than the whole model's first one,
        :meth:`name_in_stage` gives that name.
        """
        layout = cls(ranges, owners, discovery)
        d = discovery
        last = layout.num_stages - 1
        out = layout.parameter_stages
        canonical = {id(p): n for n, p in module.named_parameters()}
        seen: dict[
            str, dict[int, str]
        ] = {}  # canonical -> stage -> name there (the canonical one where it can)
        for index, name in enumerate(d.block_names):
            stage = layout.stage_of_block(index)
            for pname, param in module.get_submodule(name).named_parameters(
                prefix=name, remove_duplicate=False
            ):
                key = canonical[id(param)]
                out.setdefault(key, set()).add(stage)
                names = seen.setdefault(key, {})
                if pname == key or stage not in names:
                    names[stage] = pname
        layout.aliases = {k: v for k, v in seen.items() if any(n != k for n in v.values())}
        for pname in d.pre_parameters | d.other_parameters:
            out.setdefault(pname, set()).add(0)
        for pname in d.post_parameters:
            out.setdefault(pname, set()).add(last)
        for index, pnames in d.side_parameters.items():  # made at model level, read by these blocks
            for pname in pnames:
                out.setdefault(pname, set()).add(layout.stage_of_block(index))
        return layout

    def name_in_stage(self, name: str, stage: int) -> str:
        """The name ``stage``'s rank knows the weight ``name`` (canonical) by, after its blocks are cut."""
        return self.aliases.get(name, {}).get(stage, name)

    def name_on_rank(self, name: str, pp_rank: int) -> str:
        """The name pipeline rank ``pp_rank`` knows ``name`` by: its first stage holding the weight decides."""
        held = sorted(s for s in self.parameter_stages.get(name, ()) if self.owners[s] == pp_rank)
        return self.name_in_stage(name, held[0]) if held else name

    def aliases_on_rank(self, pp_rank: int) -> dict[str, str]:
        """This rank's name -> the whole model's (canonical) one, for the weights it knows by another name."""
        return {local: n for n in self.aliases if (local := self.name_on_rank(n, pp_rank)) != n}

    def tied_across_ranks(self) -> dict[str, tuple[int, ...]]:
        """Parameters held by stages on different pipeline ranks -> those ranks (sorted)."""
        out = {}
        for name, stages in sorted(self.parameter_stages.items()):
            ranks = tuple(sorted({self.owners[s] for s in stages}))
            if len(ranks) > 1:
                out[name] = ranks
        return out


@dataclass
class StageRuntime:
    """What the hooks read while a stage runs (set by the runner around each stage forward)."""

    active_stage: int | None = None
    # of the stage forward running now (not restored in a recomputation)
    active_micro_batch: int | None = None
    injected: torch.Tensor | None = None
    handles: list[RemovableHandle] = field(default_factory=list)


def cut_into_stages(
    module: nn.Module, layout: StageLayout, my_stages: list[int], runtime: StageRuntime
) -> set[str]:
    """Apply the surgery for the stages in ``my_stages``; returns the canonical names of the kept parameters."""
    d = layout.discovery
    owned_names = {
        layout.name_in_stage(n, min(stages & set(my_stages)))
        for n, stages in layout.parameter_stages.items()
        if stages & set(my_stages)
    }
    # Parameters outside the blocks that this rank does not own become zero placeholders.
    block_ids = {id(p) for name in d.block_names for p in module.get_submodule(name).parameters()}
    canonical = {id(p): n for n, p in module.named_parameters()}
    for holder in module.modules():
        for attr, param in list(holder.named_parameters(recurse=False)):
            if id(param) in block_ids or canonical[id(param)] in owned_names:
                continue
            del holder._parameters[attr]
            setattr(holder, attr, torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape))
    for index, name in enumerate(d.block_names):
        stage = layout.stage_of_block(index)
        if stage not in my_stages:
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, child, SkippedBlock(name, d.template, module.get_submodule(name)))
        elif len(my_stages) > 1:
            _gate(module.get_submodule(name), stage, d.template, runtime)
    for stage in my_stages:
        first = module.get_submodule(d.block_names[layout.ranges[stage][0]])
        last = module.get_submodule(d.block_names[layout.ranges[stage][-1]])
        if stage > 0:
            runtime.handles.append(
                first.register_forward_pre_hook(_injector(stage, runtime), with_kwargs=True)
            )
        if stage < layout.num_stages - 1:
            runtime.handles.append(last.register_forward_hook(_exiter(stage, runtime)))
    return owned_names


def _gate(block: nn.Module, stage: int, template: OutputTemplate, runtime: StageRuntime) -> None:
    """Pass ``block`` through while another stage of this rank runs (its forward starts at line one too)."""
    original = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if runtime.active_stage is not None and runtime.active_stage != stage:
            return template.build(find_hidden(args, kwargs)[1])
        return original(*args, **kwargs)

    block.forward = forward  # type: ignore[method-assign]


def _injector(stage: int, runtime: StageRuntime) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if runtime.active_stage != stage or runtime.injected is None:
            return None
        where, _ = find_hidden(args, kwargs)
        return replace_hidden(args, kwargs, where, runtime.injected)

    return hook


def _exiter(stage: int, runtime: StageRuntime) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if runtime.active_stage == stage:
            # contiguous: a point-to-point send needs it (a hidden state made by a transpose keeps its strides)
            raise StageExit(OutputTemplate.hidden_of(output).contiguous())

    return hook


RunStage = Callable[[int, torch.Tensor | None, int], Any]
"""One stage's part of the user's step for one micro-batch: (stage, what it received, micro-batch index)."""


class StageModule(nn.Module):
    """The ``submodule`` torch's ``PipelineStage`` runs: the user's step, cut to one stage.

    Its parameters are exactly the stage's (the zero-bubble schedules compute weight gradients for
    ``submod.parameters()``), looked up by name on the user's module at every call: under ZeRO on
    FSDP2 a module holds its sharded or its gathered weights depending on the moment, and the
    weight gradients belong to the gathered ones. The step itself is the runner's: ``run(stage, received,
    micro-batch)`` (``PipelineRunner.run_stage``).
    """

    def __init__(self, stage_index: int, root: nn.Module, names: Iterable[str], run: RunStage) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.parameter_names = sorted(names)
        object.__setattr__(self, "_root", root)  # not submodules: no second copy of their parameters
        object.__setattr__(self, "_run", run)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for name in self.parameter_names:
            yield registered_parameter(self._root, name)

    def forward(self, *received: torch.Tensor, mb_index: torch.Tensor) -> torch.Tensor:
        return self._run(self.stage_index, received[0] if received else None, int(mb_index.item()))
