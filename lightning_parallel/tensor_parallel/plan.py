"""What the strategy will do to a model, as data: which module gets which sharding.

A ``ParallelPlan`` is produced by :func:`~lightning_parallel.plans.auto.auto_plan` (or from a
user's ``plan=`` dict), applied by :mod:`lightning_parallel.tensor_parallel`, and printed for
the user before an expensive job starts (``print(strategy.plan)``): every sharded module with
its style, the attributes rewritten for local shards, what stays replicated and why, and the
parameter memory per rank against the unsharded model. It lives here, beside the
styles it names and the code that applies it, so that ``plans`` (which builds plans) depends on
``tensor_parallel`` and never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

ContainerKind = Literal["attention", "mlp"]


class EntryVariant(NamedTuple):
    """One way to shard a container's entries that their shapes cannot tell from another: the styles of
    the entries it changes, and the local values of attributes it changes (``ShardedContainer.variants``)."""

    label: str
    styles: dict[str, ParallelStyle]
    scaled_attributes: dict[str, tuple[int, int]] | None = None
    fused: bool = True  # the rows of one fused projection (else of separate ones)

    @property
    def description(self) -> str:
        return f"fused entry {self.label}" if self.fused else self.label


@dataclass
class ShardedContainer:
    """An attention or MLP module whose projections are split Megatron-style.

    ``entries`` are the projections that read the container's input (column parallel),
    ``exit`` the one that produces its output (row parallel). ``scaled_attributes`` are the
    integer attributes (head counts, widths) that the unchanged module code reads and that
    must describe the *local* shard: ``{name: (global value, local value)}``.
    ``narrow_input`` is decided at setup by verification: True when the module reads the
    model width from its input tensor and therefore must be shown a width-sliced input.
    ``variants``: the ways the entries can be sharded when their layout cannot be told from their
    shapes (a fused projection's rows, heads paired across halves: :class:`EntryVariant`), the first
    in ``styles`` until the verification chooses, ``variant``. ``slice_heads``: tensors the attention receives with a
    dimension per head (ALiBi biases made at model level) are cut to this rank's heads (decided
    by the verification too).
    """

    name: str
    kind: ContainerKind
    entries: list[str]
    exit: str
    scaled_attributes: dict[str, tuple[int, int]] = field(default_factory=dict)
    hidden_size: int = 0
    narrow_input: bool = False
    variants: list[EntryVariant] = field(default_factory=list)
    variant: int = 0
    heads: int = 0  # attention heads of the whole model (for ``slice_heads``)
    slice_heads: bool = False
    copy_output: bool = False  # the exit's output copied: the model adds to it in place (Falcon's MLP)
    copy_entry_outputs: bool = (
        False  # the entries' outputs copied: the model changes them in place (OLMo's clamp)
    )
    inner_gathered: bool = False  # an MLP's hidden units gathered: its code reduces over them (Gemma 3n)

    @property
    def variant_label(self) -> str | None:
        return self.variants[self.variant].description if self.variants else None

    @property
    def entry_suffixes(self) -> list[str]:
        """Entry names relative to the container."""
        if not self.name:
            return list(self.entries)
        return [entry[len(self.name) + 1 :] for entry in self.entries]


@dataclass
class ParallelPlan:
    """The complete tensor/sequence-parallel plan for one model."""

    tensor_parallel: int
    sequence_parallel: bool
    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    containers: list[ShardedContainer] = field(default_factory=list)
    block_list: str | None = None
    block_names: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)
    head: str | None = None  # the output projection to the vocabulary, if sharded
    # Modules of the blocks left whole that, under sequence parallelism, run on the whole sequence (gathered
    # entering them, this rank's slice of their output leaving): a state-space or convolution mixer
    whole_sequence: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Filled by the report once the model is known: name -> (global numel, local numel, bytes/elem)
    parameter_shards: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.styles

    def style_for(self, module_name: str) -> ParallelStyle | None:
        return self.styles.get(module_name)

    def container(self, name: str) -> ShardedContainer | None:
        return next((c for c in self.containers if c.name == name), None)

    def __str__(self) -> str:
        return format_plan(self)


# ---- the report ---------------------------------------------------------------------------


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def record_parameter_shards(plan: ParallelPlan, model: nn.Module) -> None:
    """Remember global and local sizes of every parameter (call after sharding)."""
    plan.parameter_shards = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        plan.parameter_shards[name] = (param.numel(), local.numel(), param.element_size())


def format_plan(plan: ParallelPlan) -> str:
    lines = [
        f"ParallelPlan(tensor_parallel={plan.tensor_parallel}, sequence_parallel={plan.sequence_parallel})"
    ]
    if plan.block_list is not None:
        lines.append(f"  block stack: {plan.block_list} ({len(plan.block_names)} blocks)")
    width = max((len(name) for name in plan.styles), default=10)
    lines.append("  sharded modules:")
    for name, style in plan.styles.items():
        lines.append(f"    {name:<{width}}  {style!r}")
    for container in plan.containers:
        if container.scaled_attributes or container.narrow_input:
            attrs = ", ".join(f"{k} {g}->{loc}" for k, (g, loc) in container.scaled_attributes.items())
            mode = "width-sliced input" if container.narrow_input else "full-width input"
            mode += f", {container.variant_label}" if container.variant_label else ""
            mode += ", per-head inputs cut to the local heads" if container.slice_heads else ""
            mode += ", output copied" if container.copy_output else ""
            mode += ", entry outputs copied" if container.copy_entry_outputs else ""
            mode += ", hidden units gathered" if container.inner_gathered else ""
            lines.append(f"    {container.name}: {container.kind}, {mode}" + (f"; {attrs}" if attrs else ""))
    for note in plan.notes:
        lines.append(f"  note: {note}")
    if plan.parameter_shards:
        total = sum(g * b for g, _, b in plan.parameter_shards.values())
        local = sum(loc * b for _, loc, b in plan.parameter_shards.values())
        lines.append(
            f"  parameters per rank: {_human(local)} of {_human(total)} unsharded"
            f" ({local / max(total, 1):.1%}); gradients the same; Adam states 2x that in fp32"
        )
    return "\n".join(lines)
