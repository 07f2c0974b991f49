"""Communication savers: compressed data-parallel gradient all-reduce (bf16/fp16 casts, PowerSGD)."""

from lightning_parallel.comm.compression import (
    CASTS,
    BucketCompressor,
    PowerSGD,
    count_all_reduce_bytes,
    gradient_bytes,
    powersgd_payload_bytes,
    register_ddp_compression,
)

__all__ = [
    "CASTS",
    "BucketCompressor",
    "PowerSGD",
    "count_all_reduce_bytes",
    "gradient_bytes",
    "powersgd_payload_bytes",
    "register_ddp_compression",
]
