"""The ZeRO arguments of the strategy, checked at construction, and the DeepSpeed config they become.

Users say ``zero_stage=2, offload="cpu"`` and keep their ``configure_optimizers``, Trainer
precision and ``gradient_clip_val``; the DeepSpeed config is derived from those so that the one
place a setting lives is Lightning's. ``deepspeed_config`` is merged last, for the rare raw key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Offload = Literal["cpu", "nvme"]
BUCKET_ELEMENTS = 25_000_000

# Keys Lightning owns: a raw DeepSpeed value for them would disagree with the Trainer silently.
_OWNED_KEYS = {
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "gradient_clipping": "Trainer(gradient_clip_val=...)",
    "fp16": "Trainer(precision='16-mixed')",
    "bf16": "Trainer(precision='bf16-mixed')",
    "optimizer": "LightningModule.configure_optimizers",
    "scheduler": "LightningModule.configure_optimizers",
}

# Precision names -> the DeepSpeed section that implements them (fp32 master weights in the
# ZeRO optimizer, parameters in low precision on the device).
_PRECISION_SECTIONS = {
    "32-true": None,
    "32": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
}


@dataclass(frozen=True)
class ZeroArguments:
    """``zero_stage``, ``offload``, ``offload_path`` and ``deepspeed_config``, validated."""

    stage: int = 0
    offload: Offload | None = None
    offload_path: str | None = None
    raw_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.stage > 0

    @classmethod
    def resolve(
        cls,
        zero_stage: int,
        offload: str | None,
        offload_path: str | Path | None,
        deepspeed_config: Mapping[str, Any] | None,
    ) -> ZeroArguments:
        if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
            raise ValueError(
                f"`zero_stage={zero_stage!r}` must be 0 (off), 1 (optimizer states sharded), 2 (+ gradients) or"
                " 3 (+ parameters)."
            )
        if offload not in (None, "cpu", "nvme"):
            raise ValueError(f"`offload={offload!r}` must be None, 'cpu' or 'nvme'.")
        if offload is not None and zero_stage == 0:
            raise ValueError(
                f"`offload={offload!r}` needs ZeRO: offloading moves ZeRO's optimizer partitions. Set"
                " `zero_stage=1`, 2 or 3 (3 also offloads the parameters)."
            )
        if offload == "nvme":
            if zero_stage != 3:
                raise ValueError(
                    f"`offload='nvme'` with `zero_stage={zero_stage}`: DeepSpeed offloads to NVMe only at stage 3"
                    " (ZeRO-Infinity). Set `zero_stage=3`, or use `offload='cpu'` with stage 1 or 2."
                )
            if offload_path is None:
                raise ValueError(
                    "`offload='nvme'` needs `offload_path=`: a folder on a fast local disk for the swapped"
                    " parameters and optimizer states."
                )
        elif offload_path is not None:
            raise ValueError(
                f"`offload_path={str(offload_path)!r}` is only used with `offload='nvme'`; remove it or set"
                " `offload='nvme'`."
            )
        raw = dict(deepspeed_config or {})
        if raw and zero_stage == 0:
            raise ValueError("`deepspeed_config=` is only used with ZeRO: set `zero_stage=1`, 2 or 3.")
        for key, owner in _OWNED_KEYS.items():
            if key in raw:
                raise ValueError(
                    f"`deepspeed_config` sets {key!r}, which Lightning owns here: use {owner} instead, so the"
                    " Trainer and DeepSpeed cannot disagree."
                )
        stage_in_raw = raw.get("zero_optimization", {}).get("stage")
        if stage_in_raw is not None and stage_in_raw != zero_stage:
            raise ValueError(
                f"`deepspeed_config['zero_optimization']['stage']={stage_in_raw}` contradicts"
                f" `zero_stage={zero_stage}`; set the stage with `zero_stage` only."
            )
        return cls(zero_stage, offload, None if offload_path is None else str(offload_path), raw)

    def deepspeed_config(self, precision: str, gradient_clip_val: float | None) -> dict[str, Any]:
        """The config for ``deepspeed.initialize``: stage, offload, precision, clipping, user keys."""
        if precision not in _PRECISION_SECTIONS:
            raise ValueError(
                f"HybridParallelStrategy(zero_stage={self.stage}): `Trainer(precision={precision!r})` is not"
                " supported with ZeRO; use one of"
                f" {sorted(_PRECISION_SECTIONS)} (DeepSpeed keeps fp32 master weights for the half precisions)."
            )
        zero: dict[str, Any] = {
            "stage": self.stage,
            # Lightning's loop owns accumulation; ZeRO-2/3 may overlap the reduction with backward.
            "overlap_comm": self.stage >= 2,
            "contiguous_gradients": True,
            # DeepSpeed's defaults (5e8 elements) allocate 2 GB fp32 buffers per rank even for a
            # small model; 25M elements is DDP's bucket order of magnitude.
            "reduce_bucket_size": BUCKET_ELEMENTS,
            "allgather_bucket_size": BUCKET_ELEMENTS,
        }
        if self.stage == 3:
            zero["stage3_prefetch_bucket_size"] = BUCKET_ELEMENTS
        if self.offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        elif self.offload == "nvme":
            assert self.offload_path is not None
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": self.offload_path, "pin_memory": True}
            zero["offload_param"] = {"device": "nvme", "nvme_path": self.offload_path, "pin_memory": True}
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,  # only used by DeepSpeed's throughput log
            "gradient_accumulation_steps": 1,
            # Lightning calls backward once per batch and step once per optimizer step; DeepSpeed
            # must not count micro-steps itself (accumulate_grad_batches is Lightning's).
            "managed_gradient_accumulation": False,
            "gradient_clipping": float(gradient_clip_val or 0.0),
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            # A torch optimizer with offload (anything but Adam/AdamW, which become DeepSpeed's CPU Adam).
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        section = _PRECISION_SECTIONS[precision]
        if section == "bf16":
            config["bf16"] = {"enabled": True}
        elif section == "fp16":
            config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        return _merge(config, self.raw_config)


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
