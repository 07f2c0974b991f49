"""The private torch and Lightning APIs the package leans on: each one read through ``lightning_parallel/compat.py``.

``compat.PRIVATE_APIS`` lists them with the versions they were checked on. Here: every listed API exists on the
installed torch and Lightning (run in each environment the suite runs in, so an upgrade that drops one fails
here, not in a training job); no module of the package imports a private torch or Lightning API except through
``compat``; the version gates answer as the installed torch does.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_parallel import compat
from lightning_parallel.compat import PRIVATE_APIS, TORCH_VERSION, fsdp_param_groups
from lightning_parallel.zero.groups import _flat

PACKAGE = Path(compat.__file__).parent
LIBRARIES = ("torch", "lightning", "pytorch_lightning", "deepspeed")
# Modules another engineer is changing now; their private Lightning imports (and zero/engine.py's torch one)
# are listed in PRIVATE_APIS and move to compat when those files are next changed. Remove an entry then:
# test_pending_entries_are_still_pending fails to say so.
PENDING: dict[str, set[str]] = {}


def private_imports(path: Path) -> set[str]:
    """``module:name`` of every import of a private module or name of torch, Lightning or DeepSpeed."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            private_module = any(part.startswith("_") for part in node.module.split(".")[1:])
            for alias in node.names:
                if private_module or alias.name.startswith("_"):
                    found.add(f"{node.module}:{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES and any(p.startswith("_") for p in parts[1:]):
                    found.add(f"{alias.name}:")
    return found


def resolve(name: str) -> Any:
    module, _, attributes = name.partition(":")
    value: Any = importlib.import_module(module)
    for attribute in attributes.split("."):
        value = getattr(value, attribute)
    return value


def test_no_private_import_outside_compat() -> None:
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "compat.py":
            continue
        found = private_imports(path) - PENDING.get(relative, set())
        if found:
            outside[relative] = sorted(found)
    assert not outside, f"private APIs imported outside lightning_parallel/compat.py: {outside}"


def test_pending_entries_are_still_pending() -> None:
    for relative, names in PENDING.items():
        assert names <= private_imports(PACKAGE / relative), f"{relative} moved to compat: update PENDING"
        assert names <= {api.name for api in PRIVATE_APIS}, names - {api.name for api in PRIVATE_APIS}


def test_compat_lists_every_private_api_it_imports() -> None:
    listed = {api.name for api in PRIVATE_APIS}
    missing = [
        name for name in private_imports(PACKAGE / "compat.py") if not any(n.startswith(name) for n in listed)
    ]
    assert not missing, f"imported by compat.py but not in PRIVATE_APIS: {missing}"


@pytest.mark.parametrize("api", [a for a in PRIVATE_APIS if a.resolvable], ids=lambda a: a.name)
def test_private_api_exists_here(api: compat.PrivateApi) -> None:
    """Each listed API on the installed versions (torch 2.11 and 2.13 in the runs recorded in the docs)."""
    assert resolve(api.name) is not None
    assert api.via.startswith("(") or hasattr(compat, api.via), f"compat has no {api.via}"
    assert api.checked, api.name


def test_version_gates_match_this_torch() -> None:
    assert compat.selective_policy_sees_output() == (TORCH_VERSION >= (2, 13))
    assert compat.strided_shard_in_ops() == (TORCH_VERSION >= (2, 13))
    assert compat.grouped_mm is not None
    state = __import__("torch.distributed.fsdp._fully_shard._fsdp_state", fromlist=["x"]).FSDPState()
    assert fsdp_param_groups(state) == []  # a state before fully_shard has no groups, on either torch
    # Another torch: read compat.PRIVATE_APIS against it, then add its version to TORCH_CHECKED.
    assert torch.__version__.startswith(compat.TORCH_CHECKED), f"torch {torch.__version__} is not checked yet"


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


def test_without_sends_to_self(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 pairs a pipeline stage with a neighbour on its own rank (V schedules); gloo cannot."""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    ops = [SimpleNamespace(group_peer=peer, group=None) for peer in (0, 1, 0)]
    assert compat.without_sends_to_self(ops) == [ops[0], ops[2]]


def test_lightning_helpers_reach_lightning(tmp_path: Path) -> None:
    states = compat.collect_rng_states()
    assert "torch" in states
    compat.set_rng_states(states)
    assert not compat.is_full_checkpoint(tmp_path / "absent.ckpt") and not compat.is_sharded_checkpoint(
        tmp_path
    )
    assert compat.METADATA_FILENAME == "meta.pt"
