"""The main job: train the GPT recipe with a hybrid layout chosen from the devices present.

    python -m recipes.gpt.hybrid                       # tiny GPT, embedded corpus
    python -m recipes.gpt.hybrid --trainer.max_steps 50 --model.n_layer 4

On this project's 2-core CPU machines it launches 2 processes with ``tensor_parallel=2`` and
sequence parallelism; on a GPU node, all GPUs with tensor parallelism inside the node. Extra
arguments override the config (``configs/hybrid.yaml``) as with ``python -m recipes.gpt fit``.
"""

from __future__ import annotations

import sys
from importlib import resources

import yaml

from recipes.gpt.__main__ import main
from recipes.gpt.layout import auto_layout


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = resources.files("recipes.gpt") / "configs" / "hybrid.yaml"
    heads = int(yaml.safe_load(config.read_text())["model"]["n_head"])
    main(["fit", f"--config={config}", *auto_layout(heads), *argv])


if __name__ == "__main__":
    run()
