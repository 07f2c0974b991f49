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
