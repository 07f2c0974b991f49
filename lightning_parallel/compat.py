"""Every private torch and Lightning API this package leans on, in one place.

torch's private modules and attributes change between releases without notice. Each one the package
uses is imported or read here, with the torch versions it was checked on and, where they differ, a
version gate or a feature check. The next torch upgrade is one file to read: :data:`PRIVATE_APIS`
lists them, and ``tests/test_compat.py`` fails when a private torch import appears anywhere else.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SelectiveCheckpointContext

__all__ = [
    "FUSED_AS_ROWS_ENV",
    "TORCH_VERSION",
    "TorchDispatchMode",
    "fsdp_param_groups",
    "selective_policy_sees_output",
    "strided_shard_in_ops",
]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _version(torch.__version__)
"""``(major, minor)`` of the installed torch."""


def fsdp_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup``\\ s of an FSDP2 state (``FSDPModule._get_fsdp_state()``).

    torch 2.13 keeps a list, ``_fsdp_param_groups``; 2.11 has one optional group, ``_fsdp_param_group``
    (2.13 keeps that name as a property that raises when there is more than one group).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


FUSED_AS_ROWS_ENV = "LP_FUSED_AS_ROWS"
"""Set to ``1`` to store fused projections as row layouts on any torch (the tests run torch 2.11's path on 2.13)."""


def strided_shard_in_ops() -> bool:
    """Whether fused projections may be ``_StridedShard(dim, split_factor=k)`` (``tensor_parallel/styles.py``).

    torch 2.11's sharding rule for ``aten.t`` leaves ``_StridedShard(0)`` on dim 0 of the transposed weight
    inside ``F.linear``, and its redistribute plans every ``_StridedShard`` with the graph planner, which
    raises ``unable to be interpreted into a corresponding shard_order`` for a split factor that is not a
    product of mesh sizes (2 or 3 on the 1-D ``tp`` mesh). 2.13 fixes both (it falls back to the greedy
    planner). Checked: 2.11.0 (broken), 2.13.0 (works).
    """
    return TORCH_VERSION >= (2, 13) and os.environ.get(FUSED_AS_ROWS_ENV, "") != "1"


def selective_policy_sees_output() -> bool:
    """Whether selective checkpointing's policy is called after the op with ``ctx.op_output`` (torch 2.13).

    torch 2.11 calls it before the op (no ``op_output``), and again while recomputing with
    ``is_recompute=True``; ``memory/checkpointing.py`` then counts the kept outputs with a dispatch mode.
    Checked: 2.11.0 (no), 2.13.0 (yes).
    """
    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters
