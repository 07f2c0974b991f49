"""``compile=True``: ``torch.compile`` each transformer block after sharding, as torchtitan does.

Per-block compilation keeps compile time flat in depth and leaves the communication hooks
between blocks in eager mode.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_parallel.pipeline.stages import SkippedBlock
from lightning_parallel.plans.detect import find_block_stack


def compile_blocks(module: nn.Module, block_names: list[str] | None = None) -> None:
    """Compile the blocks this rank runs (``block_names``: a pipeline's full list, whose other stages' are skipped)."""
    if block_names is not None:
        blocks = [module.get_submodule(n) for n in block_names]
    else:
        stack = find_block_stack(module)
        if stack is None:
            rank_zero_warn("`compile=True`: no block list found; nothing was compiled.")
            return
        blocks = list(stack.blocks)
    for block in blocks:
        if not isinstance(block, SkippedBlock):
            block.compile()
