"""Pruning survives a sharded checkpoint, a resume in another layout, and ``export``.

The masks are the zeros of the weights: a resume rebuilds them (and the schedule's position from
the callback's state), ``export`` writes pruned weights and no mask tensors, and the exported file
loads in one process and computes what the consolidated checkpoint computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_parallel import consolidate_checkpoint
from tests.models.families import SEQ_LEN, VOCAB_SIZE, build
from tests.strategy import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "prune_checkpoint.py"


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prune_checkpoint")
    launch(str(SCRIPT), [str(out)], out, timeout_s=400).assert_all_succeeded()
    return out


def _read(out: Path, run: str) -> list[dict]:
    return [json.loads((out / f"{run}.rank{rank}.json").read_text()) for rank in range(2)]


def test_a_resume_in_another_layout_keeps_the_masks_and_the_schedule(out: Path) -> None:
    tp2, pp2 = _read(out, "tp2")[0], _read(out, "pp2")[0]
    assert tp2["last_event_step"] == 2 and tp2["pruned"] >= 0.3 * tp2["selected"] - 1
    # The event of step 2 is not repeated on resume; the next one, after step 4, raises the sparsity to 60%.
    assert [s["step"] for s in pp2["seen"]] == [4, 5, 6] and pp2["last_event_step"] == 4
    assert pp2["seen"][0]["sparsity"] == pytest.approx(0.6) and pp2["pruned"] >= 0.6 * pp2["selected"] - 1


def test_the_export_holds_the_pruned_weights_and_no_masks(out: Path) -> None:
    from safetensors.torch import load_file

    exported = load_file(out / "exported.safetensors")
    assert not [k for k in exported if "mask" in k or k.endswith("_orig")]
    model = build("recipe_gpt", n_layer=4)
    # The Linear weights the callback selects: all but the head, tied to the embedding.
    linear = [
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    ]
    zeros = sum(int((exported[n] == 0).sum()) for n in linear)
    assert zeros == _read(out, "pp2")[0]["pruned"]
    model.load_state_dict(exported)
    consolidated = build("recipe_gpt", n_layer=4)
    consolidated.load_state_dict(consolidate_checkpoint(out / "pp2" / "step6.ckpt"))
    tokens = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN))
    model.eval(), consolidated.eval()
    assert torch.equal(model(tokens), consolidated(tokens))
