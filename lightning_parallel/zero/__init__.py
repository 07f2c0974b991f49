"""DeepSpeed ZeRO (stages 1-3, CPU/NVMe offload) inside ``HybridParallelStrategy``.

- :class:`ZeroArguments`: the strategy's ``zero_stage``/``offload``/``offload_path``/``deepspeed_config``,
  validated, and the DeepSpeed config derived from them and the Trainer.
- :class:`MeshParallelUnit`: the strategy's mesh as the ``mpu`` DeepSpeed asks for its groups.
- :func:`offload_optimizer`: Adam/AdamW as DeepSpeed's CPU Adam when optimizer states are offloaded
  (on the FSDP2 engine, `sharded_cpu_adam.ShardedCPUAdam` on the local shards).
- :class:`ZeroPrecision`: backward and step through the engine.
"""

from lightning_parallel.zero.arguments import ZeroArguments
from lightning_parallel.zero.groups import MeshParallelUnit
from lightning_parallel.zero.optimizer import offload_optimizer
from lightning_parallel.zero.precision import ZeroPrecision

__all__ = ["MeshParallelUnit", "ZeroArguments", "ZeroPrecision", "offload_optimizer"]
