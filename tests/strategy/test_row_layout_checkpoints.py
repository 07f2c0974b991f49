"""Weights stored in a row layout checkpoint in the user's rows: resume, reshard, consolidate, initialise.

Gemma's one k/v head is stored on both tensor-parallel ranks, Phi-3's fused q|k|v of unequal widths in
another row order (``tensor_parallel/row_layout.py``). One launch of
``scripts/row_layout_checkpoints.py`` (2 ranks, AdamW) trains each at tp=2, saves after step 2 (sharded
and consolidated), resumes from each, reshards into two pipeline stages and initialises from the
one-process module's state dict. The files are read here without processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.strategy import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

FAMILIES = ("gemma", "phi3")
# The user's shapes of the stored weights (width 64, 4 query heads of 16): Gemma's k/v projections one
# head wide (stored two heads wide over 2 ranks), Phi-3's q|k|v 4 + 2 + 2 heads.
USER_SHAPES = {
    "gemma": {"model.model.layers.0.self_attn.k_proj.weight": (16, 64)},
    "phi3": {"model.model.layers.0.self_attn.qkv_proj.weight": (128, 64)},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("row_layouts")
    result = launch("row_layout_checkpoints.py", [str(out)], out, timeout_s=600)
    result.assert_all_succeeded()
    return out


def _run(runs: Path, family: str, name: str) -> dict:
    return json.loads((runs / family / f"{name}.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_continues_the_same_run_exactly(runs: Path, family: str) -> None:
    straight = _run(runs, family, "straight")
    assert len(straight["losses"]) == 4 and straight["losses"][2:] != straight["losses"][:2]
    for resumed in ("resumed", "resumed_full"):  # the sharded folder, and the consolidated file
        run = _run(runs, family, resumed)
        assert run["losses"] == straight["losses"][2:], (resumed, run["losses"], straight["losses"])
        assert run["weights"] == straight["weights"], resumed  # the user's view of every trained weight


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tensor_parallel_checkpoint_resumes_in_pipeline_stages(runs: Path, family: str) -> None:
    want = _run(runs, family, "straight")["losses"][2:]
    got = _run(runs, family, "resharded")["losses"]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_weights_from_the_users_state_dict(runs: Path, family: str) -> None:
    """``init_weights=`` the unparallelised module's state dict: the first loss is the one-process module's."""
    assert _run(runs, family, "initialised")["losses"][0] == pytest.approx(
        _run(runs, family, "one_process")["first_loss"], rel=1e-6
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_hold_the_users_rows(runs: Path, family: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(runs / family / "step2.ckpt")).read_metadata().state_dict_metadata
    full = torch.load(runs / family / "step2.full.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    for name, shape in USER_SHAPES[family].items():
        assert tuple(metadata[f"state_dict.{name}"].size) == shape
        assert tuple(full[name].shape) == shape
    one_process = torch.load(runs / family / "init.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in one_process.items()}
