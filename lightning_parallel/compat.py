"""Every private torch and Lightning API this package leans on, in one place.

torch's private modules and attributes change between releases without notice. Each one the package
uses is imported or read here, with the torch versions it was checked on and, where they differ, a
version gate or a feature check. The next torch upgrade is one file to read: :data:`PRIVATE_APIS`
lists them, and ``tests/test_compat.py`` fails when a private torch import appears anywhere else.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["FUSED_AS_ROWS_ENV", "TORCH_VERSION", "fsdp_param_groups", "strided_shard_in_ops"]


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
