"""The outcome of every coverage-declaring test in one run, for the compatibility page (issue 33).

A ✓ in ``docs/compatibility.md`` must come from a test that passed, not from a marker that was
collected. With ``LP_COMPAT_RESULTS=<file>`` in the environment, this pytest plugin (``tests/conftest.py``
loads it) writes, at the end of the session, the node ids of the tests carrying a ``compat``,
``compat_refused`` or ``zoo`` marker that passed, with the torch version and the date;
``python -m tools.compat_matrix --run`` runs those tests with it set and writes the page from the file.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest

ENV = "LP_COMPAT_RESULTS"
MARKERS = ("compat", "compat_refused", "zoo")


class CompatResults:
    """Collects the outcomes of the marked tests; writes them at session finish."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.passed: set[str] = set()
        self.failed: set[str] = set()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any) -> Any:
        outcome = yield
        report = outcome.get_result()
        if not any(item.get_closest_marker(m) for m in MARKERS):
            return
        if report.failed or report.skipped:  # in setup (a fixture's launch), call or teardown
            self.failed.add(item.nodeid)
            self.passed.discard(item.nodeid)
        elif report.when == "call" and item.nodeid not in self.failed:
            self.passed.add(item.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import torch

        self.path.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "date": datetime.date.today().isoformat(),
                    "passed": sorted(self.passed),
                    "failed": sorted(self.failed),
                },
                indent=1,
            )
            + "\n"
        )


def register(config: pytest.Config) -> None:
    """Load the plugin when ``LP_COMPAT_RESULTS`` names a file."""
    path = os.environ.get(ENV)
    if path:
        config.pluginmanager.register(CompatResults(Path(path)), "lp_compat_results")
