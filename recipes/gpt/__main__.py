"""Train a GPT on the embedded corpus (or your own text) with the Lightning CLI.

One device (CPU, or one GPU)::

    python -m recipes.gpt fit --config recipes/gpt/configs/tiny.yaml

One node, 8 GPUs::

    python -m recipes.gpt fit --config recipes/gpt/configs/small.yaml --trainer.devices 8

Two nodes, 8 GPUs each, with SLURM: ``sbatch recipes/slurm/gpt.sbatch`` (requeued before the
time limit with an exact resume; docs/slurm.md), or by hand (one task per GPU; Lightning
reads the rank from SLURM)::

    srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 \\
        python -m recipes.gpt fit --config recipes/gpt/configs/small.yaml \\
        --trainer.devices 8 --trainer.num_nodes 2

Any setting can be overridden on the command line (``--trainer.max_steps 3``,
``--model.n_layer 4``, ``--data.data_path my_text.bin``); ``--print_config`` shows them all.
Bring your own text with ``python -m recipes.gpt.prepare input.txt output.bin``. Logs,
the resolved config and checkpoints go to ``runs/<name>/version_<n>/``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_parallel  # noqa: F401  (registers "hybrid_parallel" and the presets with Lightning)
from recipes.gpt.callbacks import use_step_limited_bar
from recipes.gpt.data import TokenDataModule
from recipes.gpt.module import GPTLightningModule


class RecipeCLI(LightningCLI):
    """``LightningCLI`` of the recipes: the sequence length set once, on the model, for both sides, and
    the progress bar whose epoch field reads sensibly for a run limited by steps."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data must cut windows no longer than the model's position table; a single
        # source of truth makes a mismatch impossible.
        parser.link_arguments("model.block_size", "data.block_size")

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        return use_step_limited_bar(super().instantiate_trainer(**kwargs))


GPTCLI = RecipeCLI


def main(args: list[str] | None = None) -> RecipeCLI:
    """Parse ``args`` (default: ``sys.argv``), then run the subcommand (``fit``, ``validate``, ...)."""
    return RecipeCLI(GPTLightningModule, TokenDataModule, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
