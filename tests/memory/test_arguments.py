"""The memory and bandwidth savers' arguments: accepted values, and refusals that name the fix.

Everything here fails (or passes) in ``HybridParallelStrategy(...)``, in the user's process,
before any process is launched; ``precision="fp8"`` fails in ``Float8Precision()`` on hardware
without fp8 matmuls (every CPU: this is the only fp8 path the CPU test-suite can run).
"""

from __future__ import annotations

import pytest

from lightning_parallel import HybridParallelStrategy, PowerSGD
from lightning_parallel.memory import CheckpointingConfig


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(activation_checkpointing="full"), CheckpointingConfig("full")),
        (dict(activation_checkpointing="selective"), CheckpointingConfig("selective", ops=True)),
        (dict(activation_checkpointing="selective", activation_checkpointing_policy="ops"),
         CheckpointingConfig("selective", ops=True)),
        (dict(activation_checkpointing="selective", activation_checkpointing_policy=2),
         CheckpointingConfig("selective", every=2)),
        (dict(activation_checkpointing="selective", activation_checkpointing_policy=["*.mlp"]),
         CheckpointingConfig("selective", patterns=("*.mlp",))),
    ],
)  # fmt: skip
def test_checkpointing_arguments_resolve(kwargs: dict, expected: CheckpointingConfig) -> None:
    assert HybridParallelStrategy(**kwargs).memory_savers.checkpointing == expected


def test_saver_arguments_are_off_by_default() -> None:
    savers = HybridParallelStrategy().memory_savers
    assert savers.checkpointing is None and not savers.offload and savers.compression is None
    assert savers.gradient_compression is None


def test_gradient_compression_values() -> None:
    assert (
        HybridParallelStrategy(gradient_compression="powersgd").memory_savers.gradient_compression
        == PowerSGD()
    )
    assert (
        HybridParallelStrategy(gradient_compression=PowerSGD(rank=2)).memory_savers.gradient_compression.rank
        == 2
    )
    assert HybridParallelStrategy(gradient_compression="bf16").memory_savers.gradient_compression == "bf16"
    # With pipeline stages the pipeline's own all-reduce compresses, also under tensor parallelism.
    strategy = HybridParallelStrategy(tensor_parallel=2, pipeline_parallel=2, gradient_compression="fp16")
    assert strategy.memory_savers.gradient_compression == "fp16"


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(activation_checkpointing="everything"),
         ["`activation_checkpointing='everything'` is not supported", "'full'", "'selective'"]),
        (dict(activation_checkpointing=True), ["`activation_checkpointing=True` is not supported"]),
        (dict(activation_checkpointing_policy=2),
         ["`activation_checkpointing_policy=2` needs `activation_checkpointing='selective'`"]),
        (dict(activation_checkpointing="full", activation_checkpointing_policy="ops"),
         ["`activation_checkpointing='full'` recomputes every block", "activation_checkpointing='selective'"]),
        (dict(activation_checkpointing="selective", activation_checkpointing_policy=0),
         ["`activation_checkpointing_policy=0`", "k >= 1"]),
        (dict(activation_checkpointing="selective", activation_checkpointing_policy="attention"),
         ["`activation_checkpointing_policy='attention'` is not supported", "'ops'", "module-name patterns"]),
        (dict(activation_checkpointing="selective", activation_checkpointing_policy=[]),
         ["`activation_checkpointing_policy=[]` is not supported"]),
        (dict(activation_offload="cpu"), ["`activation_offload='cpu'` must be True or False"]),
        (dict(activation_compression="int8"),
         ["`activation_compression='int8'` is not supported", "'bf16'", "'fp8'"]),
        (dict(gradient_compression="1bit"),
         ["`gradient_compression='1bit'` is not supported", "'powersgd'", "PowerSGD(rank=...)"]),
        (dict(gradient_compression="powersgd", tensor_parallel=2),
         ["`gradient_compression='powersgd'` with `tensor_parallel=2` is not supported", "FSDP2",
          "`tensor_parallel=1`", "`pipeline_parallel` > 1"]),
        (dict(gradient_compression="bf16", tensor_parallel=2, expert_parallel=2),  # experts change nothing
         ["`gradient_compression='bf16'` with `tensor_parallel=2` is not supported", "FSDP2"]),
        (dict(activation_checkpointing="selective", pipeline_parallel=2, pipeline_schedule="zbv"),
         ["`activation_checkpointing='selective'` (policy 'ops') with `pipeline_schedule='zbv'` is not supported",
          "runs backward twice", "activation_checkpointing='full'"]),
    ],
)  # fmt: skip
def test_bad_saver_arguments_are_refused_at_construction(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(rank=0), "`PowerSGD(rank=0)`"),
        (dict(start_iter=1), "`PowerSGD(start_iter=1)`: torch's PowerSGD"),
    ],
)
def test_bad_powersgd_settings(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        PowerSGD(**kwargs)


def test_fp8_precision_is_refused_on_hardware_without_fp8() -> None:
    """Every CPU lacks fp8 matmuls: the constructor refuses with the reason. On a GPU that has them
    (the lent H200) the same call must succeed instead."""
    from lightning_parallel.precision.fp8 import Float8Precision, fp8_supported

    supported, reason = fp8_supported()
    if supported:
        assert not Float8Precision().emulate
        return
    with pytest.raises(ValueError) as info:
        Float8Precision()
    message = str(info.value)
    assert "Float8Precision (precision 'fp8')" in message and reason in message
    assert "precision='bf16-mixed'" in message and "compute capability 8.9" in message


def test_fp8_plugin_plumbing_in_emulation_on_cpu() -> None:
    """torchao's fp8 emulation runs on a CPU: the plugin converts the linears, names unchanged, and trains."""
    import logging
    import warnings

    import lightning as L

    from lightning_parallel.precision.fp8 import Float8Precision
    from tests.models.families import build, make_dataloader

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    model = build("recipe_gpt")
    names = list(model.state_dict())
    plugin = Float8Precision(emulate=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(), plugins=[plugin],
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, make_dataloader(2, 4))
    assert type(model.model.transformer.h[0].attn.qkv).__name__ == "Float8Linear"
    assert list(model.state_dict()) == names
    # 4 linears per block and the head; the head stays tied to the embedding (one Parameter).
    assert len(plugin.converted) == 9
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(4.8, abs=0.2)


def test_gradient_compression_with_tensor_parallel_is_one_rule() -> None:
    """The launch, where ``tensor_parallel="auto"`` is resolved, refuses with the constructor's own rule (it
    allowed the pair with experts, untested, where the constructor refused it)."""
    from lightning_parallel.config.validation import compression_with_tensor_parallel_problem

    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(gradient_compression="bf16", tensor_parallel=2, expert_parallel=2)
    assert str(info.value) == compression_with_tensor_parallel_problem("bf16", 2, None)
    assert compression_with_tensor_parallel_problem("bf16", 1, None) is None


@pytest.mark.parametrize("devices", [2, 4])
def test_tensor_parallel_auto_with_compression_is_refused_at_launch_as_an_integer_degree(
    devices: int,
) -> None:
    """``tensor_parallel="auto"`` takes every device of the node: with 2 devices no rank is left for data
    parallelism, where the launch had only warned that compression does nothing; an integer degree is refused
    there at construction, so ``"auto"`` is refused too, on 2 devices as on 4."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_parallel.config.validation import (
        check_launch,
        compression_with_tensor_parallel_problem,
        resolve_dims,
    )

    strategy = HybridParallelStrategy(gradient_compression="bf16", tensor_parallel="auto")
    dims = resolve_dims(strategy.config, "HybridParallelStrategy", devices, 1)
    assert dims.tensor_parallel == devices
    with pytest.raises(ValueError) as info:
        check_launch(strategy.config, dims, MixedPrecision("bf16-mixed", "cpu"))
    assert str(info.value) == compression_with_tensor_parallel_problem("bf16", devices, None)
    # the control: compression over data parallelism alone launches
    plain = HybridParallelStrategy(gradient_compression="bf16")
    check_launch(
        plain.config,
        resolve_dims(plain.config, "HybridParallelStrategy", devices, 1),
        MixedPrecision("bf16-mixed", "cpu"),
    )
