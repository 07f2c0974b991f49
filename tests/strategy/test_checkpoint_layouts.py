"""Checkpoints across layouts: each resharding pair both ways, weights in from one file, out to one file.

Three launches of ``scripts/checkpoint_layouts.py`` (2, 4, then 2 ranks; see its docstring) run
every layout from the same weights ``W`` (a single safetensors / ``torch.save`` file loaded with
``init_weights``), save mid-epoch, and resume each other's checkpoints: tp 2 <-> 1, pp 2 <-> 4,
ep 2 <-> 1, dp 4 <-> 2, cp 2 <-> dp 2, cp 2 <-> 4, and pp 2 <-> dp 2 of a model whose first and last blocks share a module. The last launch ends with the one-process runs from ``W``, which every
run must follow within the parity tolerance (RTOL per step): the runs that imported ``W`` from
the start, and the readers after resharding. The checkpoints taken before the first step export
(without processes) to exactly ``W``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.strategy import launch
from tests.strategy.scripts.checkpoint_layouts import EXPORTED, LAYOUTS, PAIRS, SAVE_AT, STEPS

pytestmark = [pytest.mark.distributed]

RTOL = 1e-5


def _read(out: Path, run: str) -> list[dict]:
    world_size = 4 if run.endswith(("pp4", "dp4", "cp4")) else 2
    return [json.loads((out / f"{run}.rank{rank}.json").read_text()) for rank in range(world_size)]


def _assert_follows(losses: list[float], reference: list[float], first_step: int, what: str) -> None:
    assert len(losses) == len(reference), f"{what}: {losses} vs {reference}"
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=True), start=first_step):
        assert abs(loss - ref) <= RTOL * abs(ref), (
            f"{what}, step {step}: {loss} vs {ref}\n{losses}\n{reference}"
        )


def _mean_loss(results: list[dict]) -> list[float]:
    """The global batch's loss: the mean over the ranks that hold one (data-parallel ranks each their own)."""
    per_rank = [r["losses"] for r in results if r["losses"]]
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("checkpoint_layouts")
    for mode, world_size in (("write2", 2), ("world4", 4), ("read2", 2)):
        result = launch("checkpoint_layouts.py", [mode, str(out)], out, world_size=world_size, timeout_s=400)
        print(f"{mode}: {result.wall_s:.1f} s")
        result.assert_all_succeeded()
    return out


def _reference(out: Path, layout: str) -> list[float]:
    return json.loads((out / f"reference_{LAYOUTS[layout][0]}.json").read_text())["losses"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_weights_from_one_file_train_like_the_one_process_run(runs: Path, layout: str) -> None:
    """``init_weights`` (safetensors, or a ``torch.save`` file of the inner model) in every layout:
    all 6 steps follow the one-process run that started from the same weights."""
    results = _read(runs, layout)
    assert all(r["global_step"] == STEPS for r in results)
    _assert_follows(_mean_loss(results), _reference(runs, layout), 1, f"{layout} from W")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("writer", "reader"), PAIRS, ids=[f"{w}_to_{r}" for w, r in PAIRS])
def test_a_checkpoint_resumes_in_another_layout(runs: Path, writer: str, reader: str) -> None:
    results = _read(runs, f"{writer}_to_{reader}")
    assert all(r["global_step"] == STEPS for r in results)
    for r in results:  # mid-epoch: the reader continues with batch SAVE_AT of epoch 0
        assert [b[:2] for b in r["batches"]] == [[0, 3], [1, 0], [1, 1]], r["batches"]
    reference = _reference(runs, reader)[SAVE_AT:]
    _assert_follows(_mean_loss(results), reference, SAVE_AT + 1, f"{writer} checkpoint resumed as {reader}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", EXPORTED)
def test_export_gives_the_unparallelised_state_dict(runs: Path, layout: str, tmp_path: Path) -> None:
    """The checkpoint taken before the first step, exported to one file: exactly ``W``, every name of the
    unparallelised module, bit for bit (fused q|k|v of tp=2, both pipeline stages, all experts, a module two
    stages share under each block's name)."""
    from safetensors.torch import load_file

    from lightning_parallel import export_checkpoint

    exported = load_file(export_checkpoint(runs / layout / "step0.ckpt", tmp_path / "out.safetensors"))
    weights = load_file(runs / f"{LAYOUTS[layout][0]}.safetensors")
    assert sorted(exported) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(exported[name], tensor), name
