"""The names ``Trainer(strategy=name)`` accepts for :class:`~lightning_parallel.HybridParallelStrategy`."""

from __future__ import annotations

from typing import Any

# ``Trainer(strategy=name)``: (name, description, arguments).
PRESETS: list[tuple[str, str, dict[str, Any]]] = [
    ("hybrid_parallel", "Data + tensor (+ sequence) parallelism for unchanged modules", {}),
    ("tp2", "tensor_parallel=2", {"tensor_parallel": 2}),
    (
        "tp2_sp",
        "tensor_parallel=2 with sequence parallelism",
        {"tensor_parallel": 2, "sequence_parallel": True},
    ),
    ("tp_auto", "tensor parallel over each node", {"tensor_parallel": "auto"}),
]
