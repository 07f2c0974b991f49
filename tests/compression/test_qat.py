"""Quantization-aware training (torchao's prepare step) under dp2, pp2 and ZeRO-1 equals the one-process QAT run.

One optimizer step, fp32, the project's 1e-5 on the loss and every parameter. Why one: fake
quantisation rounds every weight and activation, so the 1e-8 differences that data parallelism's
summation order leaves in the weights after a step move a few values across a rounding boundary,
and from the second step the runs part by 2e-5 (measured under dp2), as two GPUs would. The
first step is where the layouts must agree exactly: the same fake-quantised forward, the same
straight-through gradients, reduced over the layout. The control trains the float model in the
distributed run and must fail. Conversion: the trained weights, exported and converted in one
process, give torchao's quantised model, which ``torch.save`` round-trips to the same outputs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_parallel.compression.qat import QuantizationAwareTraining, convert_qat, post_training_quantize
from tests.distributed.cases import Case, StrategySpec, hybrid
from tests.distributed.harness import Result, assert_parity, reference
from tests.models.families import SEQ_LEN, VOCAB_SIZE, build

QAT = StrategySpec("lightning_parallel.compression.qat:QuantizationAwareTraining", {"scheme": "8da4w"})


def _case(name: str, callback: StrategySpec = QAT, **kwargs: object) -> Case:
    return hybrid(name, "recipe_gpt", world_size=2, timeout=60, **kwargs).replace(
        callbacks=(callback,), steps=1
    )


CASES = [
    _case("qat_dp2_recipe_gpt"),
    _case("qat_pp2_recipe_gpt", pipeline_parallel=2, micro_batches=2),
    _case("qat_zero1_dp2_recipe_gpt", zero_stage=1),
]
CONTROL = _case(
    "qat_float_dp2_recipe_gpt", StrategySpec("tests.compression.controls:QATOnOneProcessOnly", {})
)


@pytest.fixture(scope="module")
def results(two_process_compression: dict[str, Result]) -> dict[str, Result]:
    return two_process_compression  # tests/compression/conftest.py: one launch with the other files' cases


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_qat_matches_the_one_process_qat_run(results: dict[str, Result], case: Case) -> None:
    assert_parity(results[case.name], reference(case))


@pytest.mark.distributed
def test_float_training_against_qat_fails_the_parity_negative_control(results: dict[str, Result]) -> None:
    with pytest.raises(AssertionError, match="does not match"):
        assert_parity(results[CONTROL.name], reference(CONTROL))


def test_the_converted_model_runs_and_round_trips_through_torch_save(tmp_path: Path) -> None:
    tokens = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN))
    trained = build("recipe_gpt").eval()
    float_logits = trained(tokens)
    model = convert_qat(trained, "8da4w")
    logits = model(tokens)
    assert "IntxUnpackedToInt8Tensor" in type(model.model.transformer.h[0].mlp.fc.weight).__name__
    assert 0 < float((logits - float_logits).abs().max()) < 0.5  # quantised, and close to the float model
    torch.save(model.state_dict(), tmp_path / "quantised.pt")
    again = convert_qat(build("recipe_gpt", seed=3).eval(), "8da4w")
    again.load_state_dict(torch.load(tmp_path / "quantised.pt", weights_only=False), assign=True)
    assert torch.equal(again(tokens), logits)
    int8 = convert_qat(build("recipe_gpt").eval(), "8da8w")  # int8 weights per output channel
    assert 0 < float((int8(tokens) - float_logits).abs().max()) < float((logits - float_logits).abs().max())
    ptq = post_training_quantize(build("recipe_gpt").eval(), "8da4w")
    assert torch.equal(ptq(tokens), logits)  # untrained: QAT's conversion is the same quantisation


def test_bad_input_fails_with_the_argument_named() -> None:
    with pytest.raises(ValueError, match="scheme='4w'"):
        QuantizationAwareTraining("4w")
    with pytest.raises(ValueError, match="group_size=48"):
        convert_qat(build("recipe_gpt"), "8da4w", group_size=48)
    trainer = SimpleNamespace(strategy=SimpleNamespace(dims=SimpleNamespace(tensor_parallel=2)))
    with pytest.raises(
        ValueError, match="tensor_parallel=2"
    ):  # at setup, before the strategy shards anything
        QuantizationAwareTraining().setup(trainer, build("recipe_gpt"), "fit")  # type: ignore[arg-type]
