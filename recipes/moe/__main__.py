"""Train a GPT-MoE on the embedded corpus (or your own text) with the Lightning CLI.

One device (CPU, or one GPU)::

    python -m recipes.moe fit --config recipes/moe/configs/tiny.yaml

One node, 8 GPUs (experts replicated on every rank until the strategy's expert parallelism
lands; then add ``--trainer.strategy.expert_parallel 8``)::

    python -m recipes.moe fit --config recipes/moe/configs/small.yaml --trainer.devices 8

Two nodes, 8 GPUs each, with SLURM: ``sbatch recipes/slurm/moe.sbatch`` (requeued before the
time limit with an exact resume; docs/slurm.md), or by hand (one task per GPU)::

    srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 \\
        python -m recipes.moe fit --config recipes/moe/configs/large-8e-1b.yaml \\
        --trainer.devices 8 --trainer.num_nodes 2

Any setting can be overridden (``--trainer.max_steps 3``, ``--model.num_experts 16``,
``--model.capacity_factor null`` for dropless routing); ``--print_config`` shows them all. Text
is prepared as for the GPT recipe (``python -m recipes.gpt.prepare``). Expert load and dropped
tokens are logged by ``recipes.moe.callbacks.ExpertLoad``; logs and checkpoints go to
``runs/<name>/version_<n>/``.
"""

from __future__ import annotations

import lightning_parallel  # noqa: F401  (registers "hybrid_parallel" and the presets with Lightning)
from recipes.gpt.__main__ import RecipeCLI
from recipes.gpt.data import TokenDataModule
from recipes.moe.module import MoEGPTLightningModule

MoECLI = RecipeCLI  # the GPT recipe's: block size linked, step-limited progress bar


def main(args: list[str] | None = None) -> MoECLI:
    """Parse ``args`` (default: ``sys.argv``), then run the subcommand (``fit``, ``validate``, ...)."""
    return MoECLI(MoEGPTLightningModule, TokenDataModule, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
