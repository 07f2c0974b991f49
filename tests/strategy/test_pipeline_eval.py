"""Forward-only pipelines (validate, test, predict) and logging from the last stage, through the Trainer.

Two ranks, two stages. Every rank must see the metrics and predictions the whole model gives
in one process (computed here from the same initial weights), including for batch sizes the
micro-batch count does not divide; ``train_loss``, computed only on the last stage, must be in
rank 0's ``callback_metrics``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.strategy import launch
from tests.strategy.scripts.pipeline_eval import MODEL, PredictingGPT, data

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("pipeline_eval")
    launch("pipeline_eval.py", [str(out)], out, timeout_s=240).assert_all_succeeded()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def whole_model(results: list[dict]) -> PredictingGPT:
    model = PredictingGPT(**MODEL)
    model.load_state_dict(results[0]["initial"])
    return model.eval()


def test_validation_metrics_equal_the_whole_model_on_every_rank(
    results: list[dict], whole_model: PredictingGPT
) -> None:
    x, y = data().tensors
    with torch.no_grad():
        losses = [
            F.cross_entropy(whole_model.model(x[i : i + 4]).flatten(0, 1), y[i : i + 4].flatten())
            for i in (0, 4, 8)
        ]
        full = F.cross_entropy(whole_model.model(x).flatten(0, 1), y.flatten())
    for rank in results:
        assert rank["validated"]["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
        assert rank["validated"]["val_ppl"] == pytest.approx(math.exp(float(full)), rel=1e-5)
        assert rank["tested"]["test_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)


def test_predictions_reach_every_rank(results: list[dict], whole_model: PredictingGPT) -> None:
    x, _ = data().tensors
    with torch.no_grad():
        expected = [whole_model.model(x[i : i + 5]) for i in (0, 5, 10)]
    for rank in results:
        assert [p.shape for p in rank["predictions"]] == [e.shape for e in expected]
        for got, want in zip(rank["predictions"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_train_loss_from_the_last_stage_is_logged_on_every_rank(results: list[dict]) -> None:
    assert [r["global_step"] for r in results] == [2, 2]
    assert results[0]["train_loss"] == results[1]["train_loss"] > 0
