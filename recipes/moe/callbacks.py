"""Expert load and dropped tokens, logged while an MoE trains.

:class:`ExpertLoad` reads the statistics every ``lightning_parallel.experts.MoE`` layer keeps
from its last training forward (``tokens_per_expert``, ``dropped_fraction``) and logs:

- ``moe/dropped_fraction`` (mean over MoE layers, on the progress bar) and
  ``moe/layer{i}/dropped_fraction``: assignments dropped by the capacity limit;
- ``moe/layer{i}/max_load``: the busiest expert's share over an even share (1.0 = balanced;
  it bounds the step time, since every expert waits for the busiest);
- the load per expert as a histogram (x = expert id, height = tokens routed to it) with loggers
  that have histograms: TensorBoard/tensorboardX (``add_histogram_raw``) and Weights & Biases;
  with the others (CSV), one scalar per expert, ``moe/layer{i}/expert{e}``: its share of tokens.

Under expert parallelism the layers count over the token group, so the numbers describe the
global batch, and rank 0 logs them.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_parallel.experts import moe_layers


def _log_histogram(logger: Any, tag: str, counts: torch.Tensor, step: int) -> bool:
    """Log ``counts`` (tokens per expert) as a histogram with one bucket per expert, if supported."""
    experiment = getattr(logger, "experiment", None)
    num = float(counts.sum())
    ids = torch.arange(counts.numel(), dtype=torch.float64)
    if hasattr(experiment, "add_histogram_raw"):  # TensorBoard / tensorboardX
        experiment.add_histogram_raw(
            tag, min=0.0, max=float(counts.numel() - 1), num=num, sum=float((ids * counts).sum()),
            sum_squares=float((ids**2 * counts).sum()), bucket_limits=(ids + 0.5).tolist(),
            bucket_counts=counts.tolist(), global_step=step,
        )  # fmt: skip
        return True
    if type(logger).__name__ == "WandbLogger":
        import wandb

        edges = torch.arange(counts.numel() + 1, dtype=torch.float64) - 0.5
        experiment.log(
            {
                tag: wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist())),
                "trainer/global_step": step,
            }
        )
        return True
    return False


class ExpertLoad(Callback):
    """Log expert load (histogram) and dropped tokens every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: Logging period; ``None`` uses the Trainer's ``log_every_n_steps``.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"`every_n_steps={every_n_steps}` must be at least 1.")
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        layers = moe_layers(pl_module)
        if not layers:
            return
        dropped = torch.stack([layer.dropped_fraction.detach().float().cpu() for layer in layers])
        pl_module.log("moe/dropped_fraction", dropped.mean(), prog_bar=True, on_step=True, on_epoch=False)
        period = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % period == 0:
            self._log_load(trainer, layers, dropped)

    @rank_zero_only
    def _log_load(self, trainer: L.Trainer, layers: list, dropped: torch.Tensor) -> None:
        step = trainer.global_step
        scalars: dict[str, float] = {}
        for i, layer in enumerate(layers):
            counts = layer.tokens_per_expert.detach().double().cpu()
            share = counts / counts.sum().clamp(min=1)
            scalars[f"moe/layer{i}/dropped_fraction"] = float(dropped[i])
            scalars[f"moe/layer{i}/max_load"] = float(share.max() * counts.numel())
            for logger in trainer.loggers:
                if not _log_histogram(logger, f"moe/layer{i}/expert_load", counts, step):
                    logger.log_metrics(
                        {f"moe/layer{i}/expert{e}": float(s) for e, s in enumerate(share)}, step
                    )
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step)
