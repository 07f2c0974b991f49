"""Pick a hybrid layout from the devices present, for the one-command main job.

GPUs: every GPU of the node, tensor parallel inside the node up to the largest degree that
divides the model's heads (at most 8), data parallel over the rest. CPU: two processes with
tensor parallelism 2 (the smallest layout that exercises the collectives), sequence
parallelism on.
"""

from __future__ import annotations

import torch


def auto_layout(num_heads: int) -> list[str]:
    """Command-line overrides for ``LightningCLI``: accelerator, devices and strategy degrees."""
    if torch.cuda.is_available():
        devices = torch.cuda.device_count()
        accelerator = "gpu"
    else:
        devices = 2
        accelerator = "cpu"
    tp = max(d for d in range(1, min(devices, 8) + 1) if devices % d == 0 and num_heads % d == 0)
    return [
        f"--trainer.accelerator={accelerator}",
        f"--trainer.devices={devices}",
        "--trainer.strategy=lightning_parallel.HybridParallelStrategy",
        f"--trainer.strategy.tensor_parallel={tp}",
        f"--trainer.strategy.sequence_parallel={'true' if tp > 1 else 'false'}",
    ]
