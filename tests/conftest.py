"""Shared pytest configuration.

Markers:
    distributed: starts several CPU processes over gloo through ``tests.distributed.harness``
        (seconds to tens of seconds each). Deselect with ``-m "not distributed"``.
"""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "distributed: launches worker processes over gloo (tests/distributed/harness.py); slow"
    )
