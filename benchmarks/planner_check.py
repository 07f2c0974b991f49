"""The planner's predictions for the GPU check's measured GPT-1.3B steps (``benchmarks/memory_savers.py --large``).

The memory phase measures, on the lent H200, plain eager steps of GPT-1.3B (batch 8 x 2048, bf16
autocast, AdamW) without and with full recomputation: their time and the memory a step adds to what
stays allocated between steps (weights and AdamW's states): gradients and activations. This module
predicts both with the planner (``lightning_parallel.planner``: the ``h200`` preset, the model built on
the meta device), so ``gpu_check`` reports measured / predicted beside each.

    PYTHONPATH=. python -m benchmarks.planner_check        # prints the predictions
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.memory_savers import SHAPES
from lightning_parallel.planner import Layout, describe, load_cluster, rank_memory, step_time

__all__ = ["predictions"]


def predictions(shape_name: str = "large", cluster: str = "h200") -> dict[str, dict[str, float]]:
    """``{"none"|"full": {"step_s", "step_bytes"}}``: step time, and gradients + activations of the step."""
    from recipes.gpt.model import GPT, GPTConfig

    sizes = SHAPES[shape_name]
    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: v for k, v in sizes.items() if k != "batch_size"}, dropout=0.0))
    shape = describe(model)
    machine = load_cluster(cluster)
    out: dict[str, dict[str, float]] = {}
    for name, mode in (("none", None), ("full", "full")):
        layout = Layout(precision="bf16-mixed", micro_batch_size=sizes["batch_size"],
                        sequence_length=sizes["block_size"], activation_checkpointing=mode)  # fmt: skip
        (rank,) = rank_memory(model, layout, shape)
        out[name] = {
            "step_s": step_time(shape, layout, machine).total,
            "step_bytes": rank.gradients + rank.activations,
        }
    return out


def ratio(results: dict[str, Any], predicted: dict[str, dict[str, float]], config: str, key: str) -> float:
    """Measured / predicted, from the memory phase's results (``peak``: bytes the step added; ``step_s``)."""
    measured = results["results"][config]["peak" if key == "step_bytes" else "step_s"]
    return measured / predicted[config][key]


if __name__ == "__main__":
    for config, values in predictions().items():
        print(
            f"{config}: {values['step_s'] * 1e3:.1f} ms, {values['step_bytes'] / 2**30:.2f} GiB added by a step"
        )
