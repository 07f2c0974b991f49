"""The sweep's noise control: a mismatch stays a mismatch unless the one-process fp32 run is itself further
than the fp32 rule from float64 and the layout no further than a few times that (tools/hf_sweep.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import Result
from tools import hf_sweep


def _result(name: str, scale: float) -> Result:
    params = {"w": torch.ones(8) * (1 + scale)}
    return Result(name, [4.0 * (1 + scale)], params, 1, 1, 1, 0.0, 0.0, 0.0)


class _Case:
    name, trainer_kwargs = "c", {}

    def replace(self, **changes: Any) -> _Case:
        return self


@pytest.fixture
def fp64_run(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(spread: float) -> None:
        monkeypatch.setattr(
            "tests.distributed.harness.references", lambda cases, timeout_s: {"c": _result("exact", spread)}
        )

    return install


ROW = "failed: mismatch: parameter w: ..."


def test_a_well_conditioned_family_keeps_its_mismatch(fp64_run: Any) -> None:
    fp64_run(1e-8)  # the fp32 run is exact to the rule: any layout beyond it is wrong
    row = hf_sweep.with_noise_control(ROW, _Case(), _result("layout", 1e-3), _result("ref", 0.0), 1.0)
    assert row == ROW


def test_a_family_fp32_itself_cannot_follow_is_unjudged(fp64_run: Any) -> None:
    fp64_run(2e-2)
    row = hf_sweep.with_noise_control(ROW, _Case(), _result("layout", 3e-2), _result("ref", 0.0), 1.0)
    assert row.startswith("unjudged: the one-process fp32 run is up to 0.02") and row.endswith(ROW)


def test_negative_control_a_layout_far_beyond_fp32_s_own_error_is_a_mismatch(fp64_run: Any) -> None:
    fp64_run(2e-2)
    row = hf_sweep.with_noise_control(ROW, _Case(), _result("layout", 0.5), _result("ref", 0.0), 1.0)
    assert row == ROW


def test_copies_that_disagree_are_never_unjudged(fp64_run: Any) -> None:
    fp64_run(2e-2)
    out_of_sync = "failed: mismatch: replicas out of sync for w"
    assert (
        hf_sweep.with_noise_control(out_of_sync, _Case(), _result("l", 3e-2), _result("r", 0.0), 1.0)
        == out_of_sync
    )


def test_a_control_that_cannot_run_in_float64_leaves_the_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.distributed.harness import HarnessError

    def no_float64(cases: Any, timeout_s: float) -> Any:
        raise HarnessError("grouped_mm: got Double", None)

    monkeypatch.setattr("tests.distributed.harness.references", no_float64)
    assert hf_sweep.with_noise_control(ROW, _Case(), _result("l", 3e-2), _result("r", 0.0), 1.0) == ROW
