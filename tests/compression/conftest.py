"""One two-process launch for the pruning and distillation parity cases (a launch costs seconds to start)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import Result, run_cases


@pytest.fixture(scope="session")
def two_process_compression() -> dict[str, Result]:
    from tests.compression import test_distillation, test_pruning, test_qat

    cases = [*test_pruning.CASES, *test_pruning.CHANNEL_CASES, test_pruning.CONTROL, *test_distillation.CASES, test_distillation.CONTROL,
             *test_qat.CASES, test_qat.CONTROL]  # fmt: skip
    return run_cases(cases, 2, timeout_s=600, references_for=cases)
