"""What the strategy will do to a model, as data: which module gets which sharding.

A ``ParallelPlan`` is produced by :func:`~lightning_parallel.plans.auto.auto_plan` (or from a
user's ``plan=`` dict), applied by :mod:`lightning_parallel.tensor_parallel`, and printed for
the user before an expensive job starts (``print(strategy.plan)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch.distributed.tensor.parallel import ParallelStyle

ContainerKind = Literal["attention", "mlp"]


@dataclass
class ShardedContainer:
    """An attention or MLP module whose projections are split Megatron-style.

    ``entries`` are the projections that read the container's input (column parallel),
    ``exit`` the one that produces its output (row parallel). ``scaled_attributes`` are the
    integer attributes (head counts, widths) that the unchanged module code reads and that
    must describe the *local* shard: ``{name: (global value, local value)}``.
    ``narrow_input`` is decided at setup by verification: True when the module reads the
    model width from its input tensor and therefore must be shown a width-sliced input.
    """

    name: str
    kind: ContainerKind
    entries: list[str]
    exit: str
    scaled_attributes: dict[str, tuple[int, int]] = field(default_factory=dict)
    hidden_size: int = 0
    narrow_input: bool = False

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
        from lightning_parallel.plans.report import format_plan

        return format_plan(self)
