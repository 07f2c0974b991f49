"""DeepSpeed's C++ ops a ZeRO job needs, and the one line saying which are about to compile (minutes each)."""

from __future__ import annotations

import os

from lightning_parallel import compat
from lightning_parallel.zero.arguments import ZeroArguments

__all__ = ["announce_compilation", "ops_to_compile"]


# The C++ ops a ZeRO job loads, and what for (DeepSpeed compiles each on first use, a minute or more).
_OPS = {
    "cpu_adam": "the optimizer step on the CPU (offload)",
    "async_io": "the NVMe swapping (offload='nvme')",
    "deepspeed_shm_comm": "DeepSpeed's collectives on the CPU",
}


def ops_to_compile(zero: ZeroArguments, device_type: str) -> list[str]:
    """The ops this job needs that torch's extension cache does not hold yet (they compile on first use)."""
    needed = (["cpu_adam"] if zero.offload else []) + (["async_io"] if zero.offload == "nvme" else [])
    needed += ["deepspeed_shm_comm"] if device_type == "cpu" else []
    missing = []
    for name in needed:
        if not (compat.extension_build_directory(name) / f"{name}.so").exists():
            missing.append(name)
    return missing


def announce_compilation(zero: ZeroArguments, device_type: str) -> str | None:
    """One line saying which ops are about to compile, why, and where they are cached (None: nothing to compile)."""
    missing = ops_to_compile(zero, device_type)
    if not missing:
        return None
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    what = "; ".join(f"{name} ({_OPS[name]})" for name in missing)
    return (
        f"ZeRO: compiling DeepSpeed's C++ ops once, a minute or more each: {what}. Cached in {cache}"
        " (set TORCH_EXTENSIONS_DIR to keep one cache per environment); later runs load them in seconds."
    )
