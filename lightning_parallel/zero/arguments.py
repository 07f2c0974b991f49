"""The ZeRO arguments of the strategy and the DeepSpeed config they become (checked in ``config/validation.py``).

Users say ``zero_stage=2, offload="cpu"`` and keep their ``configure_optimizers``, Trainer
precision and ``gradient_clip_val``; the DeepSpeed config is derived from those so that the one
place a setting lives is Lightning's. ``deepspeed_config`` is merged last, for the rare raw key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Offload = Literal["cpu", "nvme"]
Reshard = Literal["step", "micro_batch"]
EngineChoice = Literal["auto", "deepspeed", "fsdp2"]
GatherDtype = Literal["stored", "compute"]
BUCKET_ELEMENTS = 25_000_000

# Keys Lightning owns: a raw DeepSpeed value for them would disagree with the Trainer silently.
OWNED_KEYS = {
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "gradient_clipping": "Trainer(gradient_clip_val=...)",
    "optimizer": "LightningModule.configure_optimizers",
    "scheduler": "LightningModule.configure_optimizers",
}

# Precision names -> the DeepSpeed section that implements them. "bf16-mixed" and "16-mixed" are what
# they are everywhere else in Lightning: fp32 parameters, gradients, reductions and master weights, the
# forward under torch.autocast. Inside the engine that is DeepSpeed's ``torch_autocast`` section: without
# it ``engine.forward`` switches off an autocast entered outside it (on a GPU; its check does not see the
# CPU's autocast), and the whole step ran in fp32 (measured on an H200: 9.8x eager). No module is marked
# for low-precision gradient communication (``lower_precision_safe_modules: []``): reductions stay fp32.
# "bf16-true" is DeepSpeed's ``bf16`` section (the module in bf16, fp32 master weights in the optimizer).
ZERO_PRECISIONS: dict[str, str | None] = {
    "32-true": None,
    "32": None,
    "bf16-mixed": "torch_autocast",
    "bf16-true": "bf16",
    "16-mixed": "torch_autocast",
}
AUTOCAST_DTYPES = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}
# Raw keys that decide the compute dtype: a user's value wins over the Trainer's flag, with a warning.
PRECISION_KEYS = ("torch_autocast", "bf16", "fp16")


@dataclass(frozen=True)
class ImportanceSplit:
    """``offload_update=ImportanceSplit(...)``: the rows with the largest gradients updated at once, the rest
    later and in the background (in the spirit of DeepSpeed's ZenFlow; the rule: ``zero/importance_split.py``).

    The exact host step makes the device wait for the whole CPU Adam whenever backward cannot hide it; here
    only ``top_rows`` of it is on the step's path. The other rows' gradients are summed on the host and
    applied every ``update_interval`` steps by a worker that runs during the next step's forward and backward.
    Not the one-process run's training: off unless asked for.
    """

    top_rows: float = 0.05
    """The fraction of each matrix's rows (dim 0, over the whole parameter, not a rank's shard) updated at every
    step: those whose gradient had the largest norm when the rows were last chosen."""
    update_interval: int = 4
    """Every this many steps, the other rows take one Adam step with the mean of their gradients since their
    last one; the update lands at the next step."""
    select_interval: int | None = None
    """Every this many steps the rows are chosen again, from that step's gradients (None: ``update_interval``); a
    multiple of ``update_interval``, so that no row changes side with gradients still pending."""

    def __post_init__(self) -> None:
        if not 0.0 < self.top_rows < 1.0:
            raise ValueError(
                f"`ImportanceSplit(top_rows={self.top_rows!r})` must lie strictly between 0 and 1 (the share of"
                " each matrix's rows updated at every step, e.g. 0.05)."
            )
        if (
            isinstance(self.update_interval, bool)
            or not isinstance(self.update_interval, int)
            or (self.update_interval < 1)
        ):
            raise ValueError(
                f"`ImportanceSplit(update_interval={self.update_interval!r})` must be a positive integer (steps"
                " between two updates of the other rows, e.g. 4)."
            )
        select = self.interval_of_selection
        if (
            isinstance(select, bool)
            or not isinstance(select, int)
            or select < 1
            or select % self.update_interval
        ):
            raise ValueError(
                f"`ImportanceSplit(select_interval={self.select_interval!r})` must be a positive multiple of"
                f" `update_interval={self.update_interval}` (rows change side only when no gradient is pending),"
                " or None."
            )

    @property
    def interval_of_selection(self) -> int:
        return self.update_interval if self.select_interval is None else self.select_interval

    def __str__(self) -> str:
        return f"importance {self.top_rows:.0%}/{self.update_interval}"


OffloadUpdate = Literal["exact", "delayed"] | ImportanceSplit


@dataclass(frozen=True)
class ZeroArguments:
    """``zero_stage``, ``offload``, ``offload_path`` and ``deepspeed_config``, validated."""

    stage: int = 0
    """``zero_stage=``: 0 off, 1 optimizer states sharded over the data-parallel ranks, 2 + gradients, 3 + parameters."""
    offload: Offload | None = None
    """``offload=``: ``"cpu"`` (optimizer states and step; parameters too at stage 3) or ``"nvme"`` (stage 3)."""
    offload_path: str | None = None
    """``offload_path=``: the folder for ``offload="nvme"``."""
    raw_config: Mapping[str, Any] = field(default_factory=dict)
    """``deepspeed_config=``: raw DeepSpeed keys merged last (not those Lightning owns)."""
    offload_ratio: float = 1.0
    """``offload_ratio=``: the fraction of the parameters offloaded (by FSDP2 unit; below 1 on FSDP2 only)."""
    reshard: Reshard = "step"
    """``zero_reshard=``: under pipeline stages, ``"step"`` gathers each unit's parameters once per step and keeps
    them and their unsharded gradients through the micro-batches (communication at the theory);
    ``"micro_batch"`` reduce-scatters gradients after every micro-batch's backward and, at stage 3, gathers
    the parameters for every forward and backward and reshards after each (ZeRO's memory at every moment,
    at ``micro_batches`` times the communication)."""

    engine: EngineChoice = "auto"
    """``zero_engine=``: ``"auto"`` picks DeepSpeed's engine or torch's FSDP2 by layout (``zero/engine_choice.py``);
    ``"fsdp2"`` forces FSDP2 (e.g. to compare the engines on one layout); ``"deepspeed"`` insists on
    DeepSpeed's, refused at setup where it cannot run the layout."""

    update: OffloadUpdate = "exact"
    """``offload_update=``: ``"exact"`` (each offloaded shard's host step during backward where that is exact,
    else after it), ``"delayed"`` (ZeRO-Offload's delayed parameter update: step i's host step runs during
    step i+1's forward and backward, which computes with the parameters before step i's update;
    ``zero/delayed_update.py``) or an :class:`ImportanceSplit` (``zero/importance_split.py``); the last two
    on FSDP2's engine."""

    gather_dtype: GatherDtype = "stored"
    """``zero_gather_dtype=``: ``"stored"`` gathers the sharded parameters as they are kept (fp32 under
    ``bf16-mixed``; autocast casts each weight at its matmul); ``"compute"`` casts each shard to the autocast
    dtype before FSDP2's all-gather (half the bytes; FSDP2's ``MixedPrecisionPolicy``, as torchtitan and
    Megatron's distributed optimizer gather 16-bit weights), with gradients reduced and kept in fp32
    (``zero/fsdp.py: gather_policy``). On FSDP2's engine only."""

    @property
    def enabled(self) -> bool:
        return self.stage > 0

    def deepspeed_config(
        self, precision: str, gradient_clip_val: float | None, largest_parameter: int = BUCKET_ELEMENTS
    ) -> dict[str, Any]:
        """The config for ``deepspeed.initialize``: stage, offload, precision, clipping, user keys.

        ``largest_parameter`` (elements) sizes the NVMe parameter swap buffers: each must hold the
        largest parameter, and DeepSpeed's default (1e8 elements, five buffers: 2 GB of pinned memory
        per rank, allocated at start-up) is sized for models of billions.

        ``precision`` is one of :data:`ZERO_PRECISIONS` (``config/validation.py`` refused the rest).
        """
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
            # DeepSpeed's default replaces torch.nn.functional.linear process-wide by its own autograd
            # function, whose in-place bias add mutates the matmul output that selective activation
            # checkpointing keeps for backward (measured: gradients 1e-2 off after 4 steps, in every later
            # run of the process too). torch's own linear, as every other layout computes it.
            zero["memory_efficient_linear"] = False
        if self.offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        elif self.offload == "nvme":
            assert self.offload_path is not None
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": self.offload_path, "pin_memory": True}
            zero["offload_param"] = {
                "device": "nvme",
                "nvme_path": self.offload_path,
                "pin_memory": True,
                "buffer_size": largest_parameter,
            }
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
        section = ZERO_PRECISIONS[precision]
        if section == "bf16":
            config["bf16"] = {"enabled": True}
        elif section == "torch_autocast":
            config["torch_autocast"] = {
                "enabled": True,
                "dtype": AUTOCAST_DTYPES[precision],
                "lower_precision_safe_modules": [],
            }
        if any(key in self.raw_config for key in PRECISION_KEYS):  # the user's sections replace ours
            for key in PRECISION_KEYS:
                config.pop(key, None)
        return _merge(config, self.raw_config)

    def precision_override(self, precision: str) -> str | None:
        """The warning for a ``deepspeed_config`` whose precision sections replace what ``precision`` builds."""
        keys = [key for key in PRECISION_KEYS if key in self.raw_config]
        if not keys:
            return None
        return (
            f"`deepspeed_config` sets {', '.join(map(repr, keys))}: DeepSpeed's engine computes as those sections"
            f" say, not as `Trainer(precision={precision!r})` would ({describe_compute(precision)}); the"
            " Trainer's precision plugin still autocasts outside the engine and owns no loss scale."
        )


def describe_compute(precision: str) -> str:
    """The dtypes a ZeRO job computes and keeps in, for the setup log."""
    if precision in AUTOCAST_DTYPES:
        dtype = AUTOCAST_DTYPES[precision]
        scaled = ", the loss scaled dynamically" if precision == "16-mixed" else ""
        return (
            f"matmuls in {dtype} under torch.autocast, parameters, gradients, reductions and master weights in"
            f" fp32{scaled}"
        )
    if precision == "bf16-true":
        return "parameters and matmuls in bfloat16, fp32 master weights in the optimizer"
    return "everything in fp32"


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
