"""Knowledge distillation under data and tensor parallelism reproduces one-process distillation.

The teacher (another seed, wider) is built in each worker; the student is the recipe GPT with its
own ``training_step``. fp32, the project's 1e-5 on every loss and parameter. Under
``loss_parallel=True`` the student's logits stay sharded over the vocabulary and the KL's
log-sum-exp runs across the tensor-parallel ranks; the negative control normalises each shard
alone and must fail.
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.compression import KnowledgeDistillation, distillation_kl
from tests.distributed.cases import Case, StrategySpec, hybrid
from tests.distributed.harness import Result, assert_parity, reference

TEACHER = {"teacher_kwargs": {"n_embd": 96}, "temperature": 2.0, "alpha": 0.7}


def _kd(target: str = "tests.compression.controls:DistilFromFamily", **kwargs: object) -> StrategySpec:
    return StrategySpec(target, {**TEACHER, **kwargs})


def _case(name: str, callback: StrategySpec | None = None, **kwargs: object) -> Case:
    return hybrid(name, "recipe_gpt", world_size=2, timeout=60, **kwargs).replace(
        callbacks=(callback or _kd(),)
    )


CASES = [
    _case("kd_dp2_recipe_gpt"),
    _case("kd_tp2_recipe_gpt", tensor_parallel=2),
    _case(
        "kd_tp2_sp_loss_parallel_recipe_gpt", tensor_parallel=2, sequence_parallel=True, loss_parallel=True
    ),
    _case("kd_topk_dp2_recipe_gpt", callback=_kd(top_k=16)),
]
CONTROL = _case("kd_shardlocal_tp2_loss_parallel_recipe_gpt", callback=_kd("tests.compression.controls:ShardLocalKD"),
                tensor_parallel=2, loss_parallel=True)  # fmt: skip


@pytest.fixture(scope="module")
def results(two_process_compression: dict[str, Result]) -> dict[str, Result]:
    return two_process_compression  # tests/compression/conftest.py: with the other file's cases, one launch


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_distillation_matches_one_process_distillation(results: dict[str, Result], case: Case) -> None:
    result, ref = results[case.name], reference(case)
    assert_parity(result, ref)
    kd, task = result.facts["last_kd_loss"], result.facts["last_task_loss"]
    assert kd > 0.01, "the distillation term engaged"
    if case.dp == 1:  # rank 0's terms are the global batch's (under dp, its half of it)
        assert kd == pytest.approx(ref.facts["last_kd_loss"], rel=1e-5)
        assert result.losses[-1] == pytest.approx(0.3 * task + 0.7 * kd, rel=1e-5), (
            "the step's loss is the mixture"
        )


@pytest.mark.distributed
def test_a_kl_normalised_per_shard_fails_the_parity_negative_control(results: dict[str, Result]) -> None:
    with pytest.raises(AssertionError, match="does not match"):
        assert_parity(results[CONTROL.name], reference(CONTROL))


def test_the_kl_is_zero_for_the_teacher_itself_and_top_k_of_all_is_the_full_kl() -> None:
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    assert float(distillation_kl(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    full = distillation_kl(student, teacher, temperature=3.0)
    assert float(distillation_kl(student, teacher, temperature=3.0, top_k=11)) == pytest.approx(
        float(full), rel=1e-6
    )
    want = (
        torch.nn.functional.kl_div(
            torch.log_softmax(student / 3.0, -1),
            torch.log_softmax(teacher / 3.0, -1),
            log_target=True,
            reduction="none",
        )
        .sum(-1)
        .mean()
        * 9.0
    )
    assert float(full) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"temperature": 0.0}, "temperature=0.0"), ({"alpha": 1.5}, "alpha=1.5"), ({"top_k": 0}, "top_k=0")],
)
def test_bad_arguments_fail_with_the_argument_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KnowledgeDistillation(torch.nn.Linear(2, 2), **kwargs)
