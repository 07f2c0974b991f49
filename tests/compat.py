"""What a test covers in the compatibility matrix (``docs/compatibility.md``), declared by markers.

The matrix pairs every two rows of :data:`ROWS` (layouts, memory savers, precisions). A pair is
*tested* when a test asserts parity with the single-process run for a layout holding both rows,
*refused* when a test asserts that the strategy refuses it at setup with a clear ``ValueError``,
and a *gap* otherwise. ``python -m tools.compat_matrix`` collects the markers (no training) and
writes the page; ``tests/test_compat_matrix.py`` fails when the committed page differs.

Markers (registered in ``tests/conftest.py``; how to use them: docs/testing.md, "Declaring coverage"):

- ``@pytest.mark.compat`` on a parity test parametrized by ``case`` (a :class:`Case`) or ``name``
  (a key of ``CASES``): the rows are derived from the case itself (strategy arguments, world
  size, ``Trainer(precision=...)``), so the declaration cannot claim more than the case runs.
- ``@pytest.mark.compat(cases=[...])``: the same for a test that is not parametrized.
- ``@pytest.mark.compat(features=("tp", "fp8"))``: rows named by hand, for parity tests outside
  the harness (scripts, ZeRO); :func:`features_of` gives the rows of a set of strategy arguments.
- ``compat_refused``: put on a refusal test by :func:`refusal`, which also hands the test the
  arguments and the message it must assert; the generator checks that the arguments hold the pair.

Rows are derived, not chosen, so the rules live here: ``dp`` means every parameter has more than
one data-parallel replica (``world_size / (tp * pp * ep * cp) > 1``; under expert parallelism the
experts' replicas count, ep=2 on 2 ranks is not dp; context ranks share their batch, cp=2 on 2
ranks is not dp either); ``sp`` needs ``tensor_parallel > 1``
(otherwise it is ignored); a pipeline row is the schedule actually run (the default is 1F1B).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from tests.distributed.cases import Case, StrategySpec

__all__ = [
    "EXCLUSIVE",
    "PRECISIONS",
    "ROWS",
    "SCHEDULES",
    "case_features",
    "features_of",
    "pairs_of",
    "refusal",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
DEFAULT_SCHEDULE = "1f1b"
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "fp8")
_SCHEDULE_ROWS = tuple(f"pp={s}" for s in SCHEDULES)
_ZERO_ROWS = ("zero1", "zero2", "zero3")
_OFFLOAD_ROWS = ("offload=cpu", "offload=nvme")
_AC_ROWS = ("ac=full", "ac=selective")
ROWS: tuple[str, ...] = (
    "dp",
    *_ZERO_ROWS,
    *_OFFLOAD_ROWS,
    "tp",
    "sp",
    *_SCHEDULE_ROWS,
    "ep",
    "cp",
    *_AC_ROWS,
    *PRECISIONS,
)
# Values of one argument: one run holds at most one of each group, so they form no pair.
EXCLUSIVE: tuple[frozenset[str], ...] = tuple(
    frozenset(g) for g in (_ZERO_ROWS, _OFFLOAD_ROWS, _SCHEDULE_ROWS, _AC_ROWS, PRECISIONS)
)
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}
_HYBRID = "lightning_parallel:HybridParallelStrategy"


def _precision(trainer_kwargs: Mapping[str, Any]) -> str:
    plugins = trainer_kwargs.get("plugins") or []
    if any(type(p).__name__ == "Float8Precision" for p in plugins):
        return "fp8"
    flag = str(trainer_kwargs.get("precision", "32-true"))
    # "16-mixed" is fp16 autocast with a loss scale on the CPU too: the harness's worker passes the plugin
    # (Lightning would turn the flag into bf16-mixed there; tests/distributed/worker.py).
    return _PRECISION_ALIASES.get(flag, flag)


def features_of(
    strategy_kwargs: Mapping[str, Any], world_size: int | None = None, precision: str = "32-true"
) -> frozenset[str]:
    """The rows a ``HybridParallelStrategy(**strategy_kwargs)`` run on ``world_size`` processes holds.

    ``world_size=None`` (a refusal at construction, before the devices are known) derives no ``dp``.
    """
    tp = strategy_kwargs.get("tensor_parallel", 1)
    tp = 2 if tp == "auto" else int(tp)
    pp = int(strategy_kwargs.get("pipeline_parallel", 1))
    ep = int(strategy_kwargs.get("expert_parallel", 1))
    cp = int(strategy_kwargs.get("context_parallel", 1))
    rows = {_PRECISION_ALIASES.get(precision, precision)}
    if world_size is not None and world_size // (tp * pp * ep * cp) > 1:
        rows.add("dp")
    if tp > 1:
        rows.add("tp")
        if strategy_kwargs.get("sequence_parallel"):
            rows.add("sp")
    if pp > 1:
        schedule = str(strategy_kwargs.get("pipeline_schedule") or DEFAULT_SCHEDULE)
        rows.add(f"pp={_canonical_schedule(schedule)}")
    if ep > 1:
        rows.add("ep")
    if cp > 1:
        rows.add("cp")
    if strategy_kwargs.get("zero_stage"):
        rows.add(f"zero{int(strategy_kwargs['zero_stage'])}")
    if strategy_kwargs.get("offload"):
        rows.add(f"offload={strategy_kwargs['offload']}")
    if strategy_kwargs.get("activation_checkpointing"):
        rows.add(f"ac={strategy_kwargs['activation_checkpointing']}")
    unknown = rows - set(ROWS)
    if unknown:
        raise ValueError(f"features_of: {sorted(unknown)} are not rows of the matrix ({ROWS})")
    return frozenset(rows)


def _canonical_schedule(name: str) -> str:
    from lightning_parallel.config.arguments import resolve_schedule

    return resolve_schedule(name).name


LOW_PRECISIONS = frozenset({"bf16-mixed", "bf16-true", "16-true", "16-mixed", "fp8"})


def case_features(case: Case) -> frozenset[str]:
    """The rows a harness case counts for in the matrix: :func:`case_rows`, and the data rule.

    A low-precision case must train on the learnable sequence (``data="learnable"``): only the
    measured-tolerance check (tests/distributed/tolerance.py, which refuses other data) may mark
    a low-precision cell tested.
    """
    rows = case_rows(case)
    if rows & LOW_PRECISIONS and case.data != "learnable":
        raise ValueError(
            f"{case.name}: a {sorted(rows & LOW_PRECISIONS)[0]} case counts in the compatibility matrix only"
            " when compared by tests/distributed/tolerance.py (data='learnable', losses and parameters within"
            " the measured tolerance)"
        )
    return rows


def case_rows(case: Case) -> frozenset[str]:
    """The rows a harness case runs (Lightning's own strategies: data parallel only)."""
    precision = _precision(case.trainer_kwargs)
    spec = case.strategy
    if isinstance(spec, StrategySpec) and spec.target == _HYBRID:
        return features_of(spec.kwargs, case.world_size, precision)
    rows = {precision}
    if case.dp > 1:
        rows.add("dp")
    return frozenset(rows)


def pairs_of(features: Iterable[str]) -> set[frozenset[str]]:
    """The pairs a parity run with these rows covers.

    A pair of two non-precision rows counts only from an fp32 run, whose parity check is strict
    (losses within 1e-5 per step and every final parameter); a low-precision run (losses and
    parameters within the tolerance measured on the one-process run, tests/distributed/tolerance.py)
    covers only the pairs with its precision.
    """
    rows = set(features)
    fp32 = "32-true" in rows
    pairs = set()
    for a, b in itertools.combinations(sorted(rows), 2):
        pair = frozenset((a, b))
        if any(pair <= group for group in EXCLUSIVE):
            continue
        if fp32 or pair & set(PRECISIONS):
            pairs.add(pair)
    return pairs


def refusal(
    pair: tuple[str, str],
    kwargs: Mapping[str, Any],
    message: str,
    *,
    world_size: int | None = None,
    precision: str = "32-true",
    id: str | None = None,
) -> Any:
    """A ``pytest.param(kwargs, message)`` for a refusal test, marked as refusing ``pair``.

    The test must assert that ``HybridParallelStrategy(**kwargs)`` (or the Trainer with it) raises a
    ``ValueError`` containing ``message``; the page shows the message. The pair must be among the
    rows of ``kwargs`` (checked here, so a marker cannot name a pair its arguments do not hold).
    """
    held = features_of(kwargs, world_size, precision)
    if not set(pair) <= held:
        raise ValueError(f"refusal{pair}: the arguments {dict(kwargs)} hold only {sorted(held)}")
    mark = pytest.mark.compat_refused(pair=tuple(pair), message=message)
    return pytest.param(dict(kwargs), message, marks=mark, id=id or "-".join(pair))
