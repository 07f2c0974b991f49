"""ZeRO arguments: the DeepSpeed config they become, the optimizer swap for offloading, refusals.

No process group: these pin down the translation from Lightning's settings (precision, clipping,
accumulation, ``configure_optimizers``) to DeepSpeed's, and that bad arguments fail at
construction with the argument, the value and the fix.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.config.arguments import zero as zero_arguments
from lightning_parallel.config.validation import check_zero_precision
from lightning_parallel.zero import offload_optimizer
from tests.compat import refusal


def test_config_follows_stage_offload_precision_and_clipping() -> None:
    config = zero_arguments(3, "cpu", None, None).deepspeed_config("bf16-true", 0.5)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu"
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    # bf16-mixed: an fp32 engine autocast inside engine.forward (not DeepSpeed's bf16 section), nothing
    # marked for low-precision gradient communication.
    mixed = zero_arguments(3, "cpu", None, None).deepspeed_config("bf16-mixed", 0.5)
    assert "bf16" not in mixed and "fp16" not in mixed
    assert mixed["torch_autocast"] == {
        "enabled": True,
        "dtype": "bfloat16",
        "lower_precision_safe_modules": [],
    }
    assert config["gradient_clipping"] == 0.5
    # Lightning counts accumulated batches; DeepSpeed must not (unmanaged mode, gas 1).
    assert config["managed_gradient_accumulation"] is False and config["gradient_accumulation_steps"] == 1

    config = zero_arguments(2, "cpu", None, None).deepspeed_config("16-mixed", None)
    assert "offload_param" not in config["zero_optimization"]  # parameters offload only at stage 3
    # 16-mixed: autocast to float16 like everywhere else (ZeroPrecision owns the dynamic loss scale).
    assert "fp16" not in config and config["torch_autocast"]["dtype"] == "float16"
    assert config["torch_autocast"]["lower_precision_safe_modules"] == []
    assert config["gradient_clipping"] == 0.0

    config = zero_arguments(3, "nvme", "/tmp/swap", None).deepspeed_config(
        "32-true", None, largest_parameter=4096
    )
    assert config["zero_optimization"]["offload_param"] == {
        "device": "nvme",
        "nvme_path": "/tmp/swap",
        "pin_memory": True,
        "buffer_size": 4096,  # each swap buffer holds the largest parameter, not DeepSpeed's 1e8 elements
    }
    assert "bf16" not in config and "fp16" not in config


def test_raw_precision_sections_replace_ours_with_a_warning() -> None:
    """A user's own DeepSpeed precision section wins (all of ours dropped), and the warning says what changes."""
    arguments = zero_arguments(2, None, None, {"bf16": {"enabled": True}})
    config = arguments.deepspeed_config("bf16-mixed", None)
    assert config["bf16"] == {"enabled": True} and "torch_autocast" not in config
    warning = arguments.precision_override("bf16-mixed")
    assert (
        warning is not None and "'bf16'" in warning and "matmuls in bfloat16 under torch.autocast" in warning
    )
    assert zero_arguments(2, None, None, None).precision_override("bf16-mixed") is None


def test_raw_deepspeed_keys_are_merged_last() -> None:
    raw = {"zero_optimization": {"stage3_max_live_parameters": 123}, "wall_clock_breakdown": True}
    config = zero_arguments(3, None, None, raw).deepspeed_config("32-true", None)
    assert config["zero_optimization"]["stage3_max_live_parameters"] == 123
    assert config["zero_optimization"]["stage"] == 3 and config["wall_clock_breakdown"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 4}, "`zero_stage=4` must be 0 (off), 1"),
        ({"zero_stage": 1, "offload": "disk"}, "`offload='disk'` must be None, 'cpu' or 'nvme'"),
        ({"offload": "cpu"}, "`offload='cpu'` needs ZeRO"),
        ({"zero_stage": 3, "offload": "nvme"}, "`offload='nvme'` needs `offload_path=`"),
        ({"zero_stage": 2, "offload": "cpu", "offload_path": "/x"}, "`offload_path='/x'` is only used with `offload='nvme'`"),
        ({"deepspeed_config": {"a": 1}}, "`deepspeed_config=` is only used with ZeRO"),
        ({"zero_stage": 2, "deepspeed_config": {"gradient_clipping": 1.0}}, "use Trainer(gradient_clip_val=...) instead"),
        ({"zero_stage": 2, "deepspeed_config": {"optimizer": {}}}, "use LightningModule.configure_optimizers instead"),
        ({"zero_stage": 2, "deepspeed_config": {"zero_optimization": {"stage": 3}}}, "contradicts `zero_stage=2`"),
        ({"zero_stage": 1, "gradient_compression": "bf16"}, "`gradient_compression='bf16'` with `zero_stage=1` is not supported"),
        ({"zero_stage": 3, "offload": "cpu", "offload_ratio": 0}, "`offload_ratio=0` must be a number in (0, 1]"),
        ({"zero_stage": 3, "offload": "cpu", "offload_ratio": 1.5}, "`offload_ratio=1.5` must be a number in (0, 1]"),
        ({"zero_stage": 3, "offload": "cpu", "offload_ratio": True}, "`offload_ratio=True` must be a number"),
        ({"zero_stage": 3, "offload_ratio": 0.5}, "`offload_ratio=0.5` needs `offload='cpu'` or 'nvme'"),
        ({"zero_stage": 1, "offload": "cpu", "offload_ratio": 0.5}, "`offload_ratio=0.5` with `zero_stage=1`"),
        ({"zero_stage": 3, "pipeline_parallel": 2, "zero_reshard": "never"}, "`zero_reshard='never'` must be 'step'"),
        ({"zero_stage": 1, "pipeline_parallel": 2, "zero_reshard": "micro_batch"}, "with `zero_stage=1`: only stages 2"),
        ({"zero_stage": 3, "zero_reshard": "micro_batch"}, "`zero_reshard='micro_batch'` needs `pipeline_parallel` > 1"),
        ({"zero_stage": 3, "pipeline_parallel": 2, "pipeline_schedule": "zbv", "zero_reshard": "micro_batch"},
         "with `pipeline_schedule='zbv'`: a zero-bubble schedule"),
        ({"zero_stage": 3, "zero_gather_dtype": "bf16"}, "`zero_gather_dtype='bf16'` must be 'stored'"),
        ({"zero_gather_dtype": "compute"}, "`zero_gather_dtype='compute'` with `zero_stage=0`"),
        ({"zero_stage": 1, "zero_gather_dtype": "compute"}, "`zero_gather_dtype='compute'` with `zero_stage=1`"),
        ({"zero_stage": 3, "zero_engine": "deepspeed", "zero_gather_dtype": "compute"},
         "`zero_gather_dtype='compute'` with `zero_engine='deepspeed'`"),
        ({"zero_stage": 2, "zero_gather_dtype": "compute", "deepspeed_config": {"steps_per_print": 10}},
         "`zero_gather_dtype='compute'` with `deepspeed_config`"),
        ({"zero_stage": 3, "zero_gather_dtype": "compute", "pipeline_parallel": 2, "pipeline_schedule": "zbv"},
         "`zero_gather_dtype='compute'` with `pipeline_schedule='zbv'`"),
    ],
)  # fmt: skip
def test_bad_zero_arguments_are_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        HybridParallelStrategy(**kwargs)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_compute_gathers_without_an_autocast_dtype_are_refused_before_launch(precision: str) -> None:
    """``zero_gather_dtype='compute'`` under a precision with nothing lower to gather in: at ``Trainer(...)``."""
    import lightning as L

    strategy = HybridParallelStrategy(zero_stage=3, zero_gather_dtype="compute")
    with pytest.raises(
        ValueError, match=rf"`zero_gather_dtype='compute'` with `Trainer\(precision='{precision}'\)`"
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, logger=False)


def test_unsupported_precision_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"`Trainer\(precision='16-true'\)` is not supported with ZeRO"):
        check_zero_precision(zero_arguments(1, None, None, None), HalfPrecision("16-true"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        refusal((f"zero{stage}", "fp8"), {"zero_stage": stage}, "cannot be used with ZeRO", precision="fp8")
        for stage in (1, 2, 3)
    ],
)
def test_fp8_plugin_is_refused_not_dropped(kwargs: dict, message: str) -> None:
    """Float8Precision (and any plugin doing more than the precision flag) would be silently dropped:
    DeepSpeed owns the casts. On this CPU machine the real plugin refuses to build (no fp8
    hardware), so a subclass of Lightning's plugin stands in for it; the check is on the type."""
    import lightning as L
    from lightning.pytorch.plugins.precision import Precision

    class Float8Like(Precision):
        precision = "bf16-mixed"

    with pytest.raises(ValueError, match=f"the precision plugin Float8Like {message}"):
        L.Trainer(
            accelerator="cpu", devices=2, strategy=HybridParallelStrategy(**kwargs), plugins=[Float8Like()]
        )


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize("adamw", [False, True])
def test_adam_becomes_deepspeed_cpu_adam_with_the_same_hyper_parameters(adamw: bool) -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    params = _params()
    optimizer = cls([{"params": params[:1], "lr": 0.01}, {"params": params[1:], "weight_decay": 0.0}],
                    lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    swapped = offload_optimizer(optimizer, [scheduler])
    assert isinstance(swapped, DeepSpeedCPUAdam) and swapped.adam_w_mode is adamw
    assert [g["params"] for g in swapped.param_groups] == [params[:1], params[1:]]
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in swapped.param_groups] == [
        (0.01, (0.8, 0.9), 1e-6, 0.05), (0.1, (0.8, 0.9), 1e-6, 0.0)
    ]  # fmt: skip
    assert scheduler.optimizer is swapped
    with warnings.catch_warnings():  # no "optimizer.step() has been overridden" after the swap
        warnings.simplefilter("error")
        scheduler.step()
    assert [g["lr"] for g in swapped.param_groups] == [0.005, 0.05]


def test_other_optimizers_stay_and_unsupported_adam_options_are_refused() -> None:
    sgd = torch.optim.SGD(_params(), lr=0.1)
    assert offload_optimizer(sgd) is sgd
    with pytest.raises(ValueError, match=r"`Adam\(amsgrad=True\)` with `offload='cpu'`"):
        offload_optimizer(torch.optim.Adam(_params(), amsgrad=True))


def test_zero3_keeps_torchs_linear() -> None:
    """DeepSpeed's stage 3 would replace torch.nn.functional.linear process-wide (its in-place bias add broke the
    outputs selective checkpointing keeps); the config turns that off."""
    assert (
        zero_arguments(3, None, None, None).deepspeed_config("32-true", None)["zero_optimization"][
            "memory_efficient_linear"
        ]
        is False
    )


def test_a_job_says_which_deepspeed_ops_it_compiles_and_why(tmp_path, monkeypatch) -> None:
    """A fresh cache: every op the layout needs is announced (a minute or more each); the built cache: none."""
    from lightning_parallel.zero.deepspeed_ops import announce_compilation

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    line = announce_compilation(zero_arguments(3, "nvme", "/tmp/x", None), "cpu")
    assert line is not None and str(tmp_path) in line
    for name in ("cpu_adam", "async_io", "deepspeed_shm_comm"):
        assert name in line
    assert "cpu_adam" not in (announce_compilation(zero_arguments(1, None, None, None), "cpu") or "")
    assert (
        announce_compilation(zero_arguments(1, None, None, None), "cuda") is None
    )  # nothing compiles for it
    built = Path(sys.prefix) / "torch_extensions"  # what tests/conftest.py built before this test
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(built))
    assert announce_compilation(zero_arguments(3, "nvme", "/tmp/x", None), "cpu") is None
