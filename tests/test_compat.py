"""The private torch APIs the package leans on: each read through ``lightning_parallel/compat.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning_parallel.compat import fsdp_param_groups
from lightning_parallel.zero.groups import _flat


def test_fsdp_param_groups_of_both_torch_versions() -> None:
    """torch 2.13 keeps a list of parameter groups; 2.11 one group or None."""
    group = object()
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[group, group])) == [group, group]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]  # 2.11
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []  # 2.11, a unit without parameters


class _Mesh:
    """A mesh as torch 2.11 answers for a flattened name whose axes are not adjacent (``pp_tp`` beside ``dp``)."""

    def __init__(self, error: type[Exception]) -> None:
        self.error, self.flattened = error, []

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            raise self.error(key)
        return SimpleNamespace(_flatten=lambda name: self.flattened.append((key, name)) or name)


def test_flat_axis_of_a_mesh_torch_2_11_cannot_slice() -> None:
    for error in (KeyError, NotImplementedError):
        mesh = _Mesh(error)
        assert _flat(mesh, ("pp", "tp")) == "pp_tp"  # type: ignore[arg-type]
        assert mesh.flattened == [(("pp", "tp"), "pp_tp")]
