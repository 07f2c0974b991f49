"""Arguments of the strategy whose features have not landed yet: refuse them clearly.

Silently ignoring ``pipeline_parallel=4`` would train a different layout than the user paid
for; an error that names the argument and the issue is the honest answer until it lands.
"""

from __future__ import annotations

from typing import Any

NOT_YET = {
    "zero_stage": (0, "DeepSpeed ZeRO sharding"),
    "offload": (None, "ZeRO CPU/NVMe offloading"),
}


def check_not_yet_supported(**arguments: Any) -> None:
    for name, value in arguments.items():
        default, feature = NOT_YET[name]
        if value != default:
            raise ValueError(
                f"HybridParallelStrategy(`{name}={value!r}`): {feature} is not supported yet in this version of"
                f" lightning_parallel. Leave `{name}` at {default!r}; data, tensor, sequence, pipeline and"
                " expert parallelism are available now."
            )


def check_layout_pairs(*, tensor_parallel: int, sequence_parallel: bool, expert_parallel: int) -> None:
    """Refuse pairs of features that cannot train correctly together (docs/compatibility.md), by name.

    Called inside ``Trainer(...)``, once ``tensor_parallel='auto'`` is resolved and before any
    process is launched, so the user reads the reason instead of a failed plan verification on
    every rank.
    """
    if sequence_parallel and tensor_parallel > 1 and expert_parallel > 1:
        raise ValueError(
            f"HybridParallelStrategy(`sequence_parallel=True`, `tensor_parallel={tensor_parallel}`,"
            f" `expert_parallel={expert_parallel}`) is not supported: under sequence parallelism each"
            " tensor-parallel rank holds a slice of the sequence, and the MoE blocks (which tensor parallelism"
            " does not shard) would route only their rank's tokens, so expert capacity, drops and the"
            " load-balancing loss would differ from the unsharded model. Nearest supported layouts:"
            f" `sequence_parallel=False` with `tensor_parallel={tensor_parallel}` and"
            f" `expert_parallel={expert_parallel}`, or `sequence_parallel=True` with `expert_parallel=1`."
        )
