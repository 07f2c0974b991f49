"""Context parallelism: every sequence split across ranks through the whole block stack, attention included.

- ``split.py``: which tokens each rank holds (load-balanced causal chunks), entering and leaving the split;
- ``blocks.py``: which chunk pairs a hop computes (causal skipping, the model's mask cut to each);
- ``ring.py``: ring attention (keys and values rotate, partial results merged by log-sum-exp);
- ``ulysses.py``: all-to-all attention (sequence split traded for a head split around attention);
- ``attention.py``: the model's ``F.scaled_dot_product_attention`` calls routed to one of the two;
- ``hooks.py``: where the split enters and leaves an unchanged model;
- ``verify.py``: each block class checked split against whole at setup;
- ``traffic.py``: bytes sent, for the benchmark and the tests.
"""

from lightning_parallel.context_parallel.attention import (
    MODES,
    ContextState,
    attend,
    route_attention,
)
from lightning_parallel.context_parallel.blocks import ChunkPairs
from lightning_parallel.context_parallel.hooks import install_entry, install_exit, split_block_inputs
from lightning_parallel.context_parallel.ring import ring_attention
from lightning_parallel.context_parallel.split import SequenceSplit, gather, scatter
from lightning_parallel.context_parallel.traffic import TRAFFIC
from lightning_parallel.context_parallel.ulysses import ulysses_attention
from lightning_parallel.context_parallel.verify import verify_blocks

__all__ = [
    "MODES",
    "TRAFFIC",
    "ContextState",
    "ChunkPairs",
    "SequenceSplit",
    "attend",
    "gather",
    "install_entry",
    "install_exit",
    "ring_attention",
    "route_attention",
    "scatter",
    "split_block_inputs",
    "ulysses_attention",
    "verify_blocks",
]
