"""Memory savers leave training equal to the single-process run, under dp=2, tp=2 and pp=2.

Recomputation (full and selective activation checkpointing) and activation offload change
where activations live, not what is computed: parity at the project's fp32 tolerance (1e-5
per step, final parameters). bf16 activation compression changes what the backward pass
reads: its losses must stay within the bound derived in :func:`compression_bound`.

One 2-process launch runs every case (the references ride along): data parallel on the recipe
GPT (DDP reducer), tensor parallel on the nanoGPT-style model (narrow attention hooks inside
every block, re-run by the recomputation; one case with sequence parallelism, whose
all-gathers are re-run too), pipeline parallel (1F1B) on the recipe GPT (its tied
embedding/head split over the two stages; also interleaved 1F1B and ZB-V with two stages per
rank, and every other schedule with each recomputation mode it allows).
"""

from __future__ import annotations

import pytest

from lightning_parallel import PowerSGD
from tests.distributed.cases import CASES, Case, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases

pytestmark = [pytest.mark.distributed]

SAVERS = {
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "offload": {"activation_offload": True},
}
LAYOUTS = {  # name: (family, tensor_parallel, pipeline_parallel, extra strategy arguments)
    "dp2": ("recipe_gpt", 1, 1, {}),
    "tp2": ("nanogpt", 2, 1, {}),
    "pp2": ("recipe_gpt", 1, 2, {"pipeline_schedule": "1f1b"}),
}
# The MoE recipe (capacity with drops, its step adds the layers' aux losses) over ep=2: the
# recomputation re-runs the all-to-all dispatch in backward; no aux-loss collector is involved
# (with one, recomputing an MoE block is refused: it would record the loss twice).
EXPERTS = {"batch_size": 4}


def _case(name: str, layout: str, fields: dict | None = None, **savers: object) -> Case:
    if name in CASES:
        return CASES[name]
    family, tp, pp, extra = (
        LAYOUTS[layout] if layout in LAYOUTS else ("recipe_moe", 1, 1, {"expert_parallel": 2})
    )
    return hybrid(name, family, world_size=2, tensor_parallel=tp, pipeline_parallel=pp, timeout=60,
                  case_fields=fields, **{**extra, **savers})  # fmt: skip


# Two stages per rank (4 blocks, 4 micro-batches): the stages' gates patch the blocks' forward
# too (chained), and zero-bubble schedules run backward twice per stage (input, then weights).
MULTI_STAGE = {"model_kwargs": {"n_layer": 4}, "batch_size": 4}


EXACT = [
    *[
        _case(f"mem_{layout}_{saver}", layout, **kwargs)
        for layout in LAYOUTS
        for saver, kwargs in SAVERS.items()
    ],
    _case("mem_tp2_sp_full", "tp2", sequence_parallel=True, activation_checkpointing="full"),
    _case("mem_pp2_full_offload", "pp2", activation_checkpointing="full", activation_offload=True),
    _case(
        "mem_pp2_interleaved_selective",
        "pp2",
        MULTI_STAGE,
        activation_checkpointing="selective",
        pipeline_schedule="interleaved_1f1b",
        micro_batches=4,
    ),
    _case(
        "mem_pp2_zbv_full_offload",
        "pp2",
        MULTI_STAGE,
        activation_checkpointing="full",
        activation_offload=True,
        pipeline_schedule="zbv",
        micro_batches=4,
    ),
]
EXACT.append(_case("mem_ep2_full", "ep2", EXPERTS, activation_checkpointing="full"))
# The rest of the compatibility matrix (docs/compatibility.md): selective recomputation re-runs
# the sequence-parallel all-gathers and the expert all-to-all; each pipeline schedule with each
# mode it allows (selective 'ops' is refused with the zero-bubble schedules: tests/strategy/test_bad_input.py).
EXACT += [
    _case("mem_tp2_sp_selective", "tp2", sequence_parallel=True, activation_checkpointing="selective"),
    _case("mem_ep2_selective", "ep2", EXPERTS, activation_checkpointing="selective"),
    # Every second projection matmul recomputed too (torchtitan's policy): under tp with sp, and across stages.
    _case("mem_tp2_sp_selective_alternate", "tp2", sequence_parallel=True, activation_checkpointing="selective",
          activation_checkpointing_policy="ops_alternate_matmuls"),
    _case("mem_pp2_selective_alternate", "pp2", MULTI_STAGE, activation_checkpointing="selective",
          activation_checkpointing_policy="ops_alternate_matmuls", micro_batches=4),
    *[
        _case(f"mem_pp2_{schedule}_{mode}", "pp2", MULTI_STAGE, activation_checkpointing=mode,
              pipeline_schedule=schedule, micro_batches=4)
        for schedule, mode in [("gpipe", "full"), ("gpipe", "selective"), ("interleaved_1f1b", "full"),
                               ("looped_bfs", "full"), ("looped_bfs", "selective"),
                               ("interleaved_zero_bubble", "full"), ("dualpipev", "full")]
    ],
]  # fmt: skip
COMPRESSED = [_case(f"mem_{layout}_bf16", layout, activation_compression="bf16") for layout in LAYOUTS]
# bf16 all-reduce of the data-parallel gradient means (the experts' own reductions stay exact).
GRADIENT_COMPRESSED = [_case("mem_ep2_grad_bf16", "ep2", EXPERTS, gradient_compression="bf16")]

# Relative error of a gradient under bf16 activation compression: at most 2^-6 (asserted on one
# step in tests/memory/test_activation_memory.py; measured 5e-3 there). A bf16 all-reduce rounds
# each rank's gradient and the sum: at most 2^-8 (tests/memory/test_comm_and_optim.py).
GRADIENT_ERROR = 2**-6
ALL_REDUCE_ERROR = 2**-8


def compression_bound(ref_losses: list[float], step: int, eps: float = GRADIENT_ERROR) -> float:
    """How far step ``step``'s loss may move when every gradient has relative error <= GRADIENT_ERROR.

    The forward pass is exact, so step 0 is exact. With SGD (learning rate lr, momentum <= 1)
    the parameters after ``k`` steps differ by at most ``lr * eps * sum_{j<k} (j + 1) |g_j|``,
    and the loss by ``|g_k|`` times that. With ``|g_j| <= 2 |g_0|`` (these short runs) and
    ``lr |g_0|^2 ~= L_0 - L_1`` (first-order decrease of the first step), the loss moves by at most
    ``eps * 4 * k (k + 1) / 2 * |L_0 - L_1|``; plus the fp32 parity tolerance.
    """
    first_decrease = abs(ref_losses[0] - ref_losses[1])
    return eps * 4 * step * (step + 1) / 2 * first_decrease + 1e-5 * abs(ref_losses[step])


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    cases = EXACT + COMPRESSED + GRADIENT_COMPRESSED
    return run_cases(cases, 2, timeout_s=600, references_for=cases)


@pytest.mark.compat  # the matrix pairs of the case parameter (tests/compat.py)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", EXACT, ids=lambda c: c.name)
def test_recomputation_and_offload_match_the_single_process_run(
    results: dict[str, Result], case: Case
) -> None:
    assert_parity(results[case.name], reference(case))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", COMPRESSED, ids=lambda c: c.name)
def test_bf16_activation_compression_stays_within_its_bound(results: dict[str, Result], case: Case) -> None:
    got, ref = results[case.name].losses, reference(case).losses
    assert len(got) == len(ref) == case.steps
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=0)  # the forward pass reads no compressed tensor
    for step in range(1, len(ref)):
        bound = compression_bound(ref, step)
        print(
            f"{case.name} step {step}: |loss - reference| = {abs(got[step] - ref[step]):.2e} (bound {bound:.2e})"
        )
        assert abs(got[step] - ref[step]) <= bound, (
            f"step {step}: {got[step]} vs {ref[step]} (bound {bound:.2e})"
        )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", GRADIENT_COMPRESSED, ids=lambda c: c.name)
def test_bf16_gradient_all_reduce_under_expert_parallelism_stays_within_its_bound(
    results: dict[str, Result], case: Case
) -> None:
    got, ref = results[case.name].losses, reference(case).losses
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=0)  # the first forward precedes any all-reduce
    for step in range(1, len(ref)):
        bound = compression_bound(ref, step, ALL_REDUCE_ERROR)
        print(
            f"{case.name} step {step}: |loss - reference| = {abs(got[step] - ref[step]):.2e} (bound {bound:.2e})"
        )
        assert abs(got[step] - ref[step]) <= bound


# Pipeline x data parallel (4 processes): the pipeline's own all-reduce compresses the
# data-parallel means. The recipe GPT's tied embedding/head lives on both stages; PowerSGD
# would approximate its gradient differently on each (own buckets, own error feedback), so it is
# averaged uncompressed: the copies must stay in sync.
PP_DP = [
    hybrid("mem_pp2_dp2_grad_bf16", "recipe_gpt", world_size=4, pipeline_parallel=2, timeout=60,
           gradient_compression="bf16"),
    hybrid("mem_pp2_dp2_powersgd", "recipe_gpt", world_size=4, pipeline_parallel=2, timeout=60,
           gradient_compression=PowerSGD(rank=2, start_iter=2)),
]  # fmt: skip


@pytest.mark.timeout(900)
def test_gradient_compression_under_pipeline_and_data_parallelism() -> None:
    results = run_cases(PP_DP, 4, timeout_s=600, references_for=PP_DP[:1])
    ref = reference(PP_DP[0]).losses  # both cases share it
    bf16, powersgd = results["mem_pp2_dp2_grad_bf16"], results["mem_pp2_dp2_powersgd"]
    for step in range(1, len(ref)):
        assert abs(bf16.losses[step] - ref[step]) <= compression_bound(ref, step, ALL_REDUCE_ERROR)
    # PowerSGD's first two steps are plain all-reduces: losses exact up to the third step.
    for step in range(3):
        assert abs(powersgd.losses[step] - ref[step]) <= 1e-5 * abs(ref[step])
    for result in (bf16, powersgd):
        assert not result.replica_mismatches, result.replica_mismatches
