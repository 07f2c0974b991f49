"""Bad input through the real ``Trainer``: refused early, on every rank, with a message that helps.

- A layout that does not fit the devices, invalid arguments, and pairs of features that do not
  compose (the refused cells of docs/compatibility.md, declared with ``tests.compat.refusal``)
  fail in ``Trainer(...)`` / ``HybridParallelStrategy(...)``, before any process is launched (so
  these run inside pytest: nothing is launched).
- A model or ``plan=`` that cannot be applied fails at setup on every rank alike (2 processes,
  launched as scripts), quickly, and leaves no process behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest

from lightning_parallel import HybridParallelStrategy
from tests.compat import refusal
from tests.strategy import launch

# ---- in the user's process, before launching --------------------------------------------------


def test_layout_that_does_not_fit_the_devices_fails_in_the_trainer_constructor() -> None:
    with pytest.raises(ValueError) as info:
        L.Trainer(
            accelerator="cpu", devices=3, strategy=HybridParallelStrategy(tensor_parallel=2), logger=False
        )
    message = str(info.value)
    for fragment in (
        "HybridParallelStrategy",
        "`tensor_parallel=2`",
        "world size 3",
        "devices=3",
        "num_nodes=1",
    ):
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_tensor_parallel_larger_than_the_devices_fails_in_the_trainer_constructor() -> None:
    with pytest.raises(ValueError, match=r"`tensor_parallel=4` .* does not divide the world size 2"):
        L.Trainer(
            accelerator="cpu", devices=2, strategy=HybridParallelStrategy(tensor_parallel=4), logger=False
        )


def test_registered_name_resolves_and_checks_the_layout() -> None:
    import lightning_parallel  # noqa: F401  (registers the names)

    with pytest.raises(ValueError, match=r"`tensor_parallel=2`.*world size 3"):
        L.Trainer(accelerator="cpu", devices=3, strategy="tp2", logger=False)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(tensor_parallel=0), "`tensor_parallel=0` must be a positive integer or 'auto'"),
        (dict(tensor_parallel="two"), "`tensor_parallel='two'` must be a positive integer or 'auto'"),
        (
            dict(plan="magic"),
            "`plan='magic'` must be 'auto', a dict of module-name patterns, or a ParallelPlan",
        ),
    ],
)
def test_invalid_arguments_are_refused_by_name(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(pipeline_schedule="2f2b", pipeline_parallel=2), "`pipeline_schedule='2f2b'` is not a known schedule"),
        (dict(micro_batches=8), "`micro_batches=8` needs `pipeline_parallel` > 1"),
        (dict(pipeline_schedule="1f1b"), "`pipeline_schedule='1f1b'` needs `pipeline_parallel` > 1"),
        (dict(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", micro_batches=3),
         "`micro_batches=3`: the 'interleaved_1f1b' schedule needs a multiple of `pipeline_parallel=2`"),
        (dict(pipeline_parallel=2, pipeline_schedule="dualpipev", micro_batches=2),
         "the 'dualpipev' schedule needs at least 2 x `pipeline_parallel` = 4 micro-batches"),
        (dict(pipeline_parallel=2, pipeline_schedule="1f1b", pipeline_virtual_stages=2),
         "the '1f1b' schedule holds one stage per rank"),
        (dict(pipeline_parallel=2, tensor_parallel=2, loss_parallel=True),
         "`loss_parallel=True` with `pipeline_parallel` > 1 is not supported"),
        (dict(pipeline_parallel=0), "`pipeline_parallel=0` must be a positive integer"),
        (dict(pipeline_parallel=2, save_distributed_checkpoint=False),
         "`save_distributed_checkpoint=False` (one consolidated file) is not supported"),
    ],
)  # fmt: skip
def test_bad_pipeline_arguments_are_refused_at_construction(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(expert_parallel=0), "`expert_parallel=0` must be a positive integer"),
        (
            dict(expert_parallel=2, moe_aux_loss_coef=-1.0),
            "`moe_aux_loss_coef=-1.0` must be a non-negative number",
        ),
    ],
)
def test_bad_expert_arguments_are_refused_at_construction(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(context_parallel=0), "`context_parallel=0` must be a positive integer (1: off)"),
        (dict(context_parallel="2"), "`context_parallel='2'` must be a positive integer"),
        (dict(context_parallel=2, context_parallel_mode="flash"), "`context_parallel_mode='flash'` must be one of"),
        (dict(context_parallel=2, compile=True), "`compile=True` with `context_parallel=2` is not supported yet"),
    ],
)  # fmt: skip
def test_bad_context_arguments_are_refused_at_construction(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(**kwargs)
    assert fragment in str(info.value)


def test_context_degree_that_does_not_divide_data_parallel_fails_in_the_trainer_constructor() -> None:
    with pytest.raises(
        ValueError, match=r"`context_parallel=2` must divide the data-parallel size 1 .*among \[1\]"
    ):
        L.Trainer(accelerator="cpu", devices=2, logger=False,
                  strategy=HybridParallelStrategy(tensor_parallel=2, context_parallel=2))  # fmt: skip


def test_context_and_expert_degrees_that_do_not_nest_fail_in_the_trainer_constructor() -> None:
    with pytest.raises(
        ValueError, match=r"`context_parallel=2` with `expert_parallel=3`: one must divide the other"
    ):
        L.Trainer(accelerator="cpu", devices=6, logger=False,
                  strategy=HybridParallelStrategy(context_parallel=2, expert_parallel=3))  # fmt: skip


def test_expert_degree_that_does_not_divide_data_parallel_fails_in_the_trainer_constructor() -> None:
    with pytest.raises(ValueError, match=r"`expert_parallel=4` must divide the data-parallel size 2"):
        L.Trainer(
            accelerator="cpu", devices=2, logger=False, strategy=HybridParallelStrategy(expert_parallel=4)
        )


def test_pipeline_degree_that_does_not_fit_the_devices_fails_in_the_trainer_constructor() -> None:
    with pytest.raises(ValueError, match=r"`pipeline_parallel=2` = 4 does not divide the world size 2"):
        L.Trainer(accelerator="cpu", devices=2, logger=False,
                  strategy=HybridParallelStrategy(tensor_parallel=2, pipeline_parallel=2))  # fmt: skip


# ---- pairs of the compatibility matrix that are refused (docs/compatibility.md) ---------------

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")
REFUSED_AT_CONSTRUCTION = [
    refusal(
        ("zero1", "offload=nvme"),
        dict(zero_stage=1, offload="nvme", offload_path="/tmp/nvme"),
        "`offload='nvme'` with `zero_stage=1`: ZeRO-1 runs on DeepSpeed's stage-1 optimizer, which swaps nothing",
    ),
    *[
        refusal(
            (f"pp={schedule}", "ac=selective"),
            dict(pipeline_parallel=2, pipeline_schedule=schedule, activation_checkpointing="selective"),
            f"`activation_checkpointing='selective'` (policy 'ops') with `pipeline_schedule={schedule!r}` is not"
            " supported: that schedule runs backward twice over each stage",
        )
        for schedule in ("interleaved_zero_bubble", "zbv", "dualpipev")
    ],
]
REFUSED_IN_THE_TRAINER = [
    refusal(
        ("sp", "ep"),
        dict(tensor_parallel=2, sequence_parallel=True, expert_parallel=2),
        "HybridParallelStrategy(`sequence_parallel=True`, `tensor_parallel=2`, `expert_parallel=2`) is not"
        " supported: under sequence parallelism each tensor-parallel rank holds a slice of the sequence",
        world_size=4,
    )
]

# DeepSpeed keeps fp32 master weights, so pure fp16 (no master copy) is refused with every ZeRO stage.
HALF = "16-true"
REFUSED_PRECISION_IN_THE_TRAINER = [
    *[
        refusal(
            (f"zero{stage}", HALF),
            dict(zero_stage=stage),
            f"HybridParallelStrategy(zero_stage={stage}): `Trainer(precision='{HALF}')` is not supported with ZeRO",
            world_size=2,
            precision=HALF,
        )
        for stage in (1, 2, 3)
    ],
    *[
        refusal(
            (f"offload={where}", HALF),
            dict(zero_stage=3, offload=where, offload_path="/tmp/nvme" if where == "nvme" else None),
            f"HybridParallelStrategy(zero_stage=3): `Trainer(precision='{HALF}')` is not supported with ZeRO",
            world_size=2,
            precision=HALF,
        )
        for where in ("cpu", "nvme")
    ],
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED_AT_CONSTRUCTION)
def test_refused_pairs_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        HybridParallelStrategy(**kwargs)
    assert message in str(info.value)
    assert re.search(r"Nearest supported|Use |Set ", str(info.value)), (
        "the message names no supported alternative"
    )


@pytest.mark.parametrize(("kwargs", "message"), REFUSED_IN_THE_TRAINER)
def test_refused_pairs_fail_in_the_trainer_constructor(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        L.Trainer(accelerator="cpu", devices=4, strategy=HybridParallelStrategy(**kwargs), logger=False)
    assert message in str(info.value)
    assert "Nearest supported layouts: `sequence_parallel=False`" in str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), REFUSED_PRECISION_IN_THE_TRAINER)
def test_refused_precisions_fail_in_the_trainer_constructor(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        L.Trainer(
            accelerator="cpu",
            devices=2,
            precision=HALF,
            strategy=HybridParallelStrategy(**kwargs),
            logger=False,
        )
    assert message in str(info.value)
    assert "use one of" in str(info.value)


def test_sequence_parallel_without_tensor_parallel_warns() -> None:
    with pytest.warns(UserWarning, match="`sequence_parallel=True` has no effect with `tensor_parallel=1`"):
        HybridParallelStrategy(sequence_parallel=True)


# ---- at setup, on every rank (2 processes) ----------------------------------------------------
# Every rank must raise the error itself: none waits in a collective for a peer that already failed
# (its process group would time out after the scripts' 30 s, or the launcher kill it 20 s after the first
# failure), so each rank's own output carries the message and no timeout.


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        pytest.param(
            "heads",
            ["ValueError: `tensor_parallel=2` does not divide the 3 attention heads of `model.transformer.h.0.attn`",
             "Choose tensor_parallel among [1, 3]"],
            id="tp-does-not-divide-heads",
        ),
        pytest.param(
            "missing-module",
            ["ValueError: `plan` pattern 'model.transformer.h.*.attn.c_proj' matches no module of GPTLightningModule",
             "Did you mean", "'model.transformer.h.0.attn.proj'"],
            id="plan-names-a-missing-module",
        ),
        pytest.param(
            "pp-more-stages-than-blocks",
            ["ValueError: The pipeline has 2 stages", "only 1 blocks", "Lower `pipeline_parallel`"],
            id="pp-more-stages-than-blocks",
        ),
        pytest.param(
            "pp-batch-not-divisible",
            ["ValueError: `micro_batches=3` does not divide the batch size 4", "multiple of 3"],
            id="pp-batch-not-divisible-by-micro-batches",
        ),
        pytest.param(
            "ep-experts-not-divisible",
            ["ValueError: ExpertParallel:", "has 3 experts, which expert_parallel=2 does not divide",
             "Choose expert_parallel among [1, 3]"],
            id="ep-does-not-divide-experts",
        ),
        pytest.param(
            "cp-length-not-divisible",
            ["ValueError: `context_parallel=2` needs a sequence length divisible by 4", "sequences of 14 tokens",
             "Pad or crop the sequences to a multiple of 4"],
            id="cp-length-not-divisible-by-2C",
        ),
        *[pytest.param(
            case,
            ["ValueError: `sequence_parallel=True` splits the sequence over the 2 tensor-parallel ranks",
             "sequences of 15 tokens", "Pad or crop the sequences to a multiple of 2 (e.g. 16 or 14)"],
            id=case,
        ) for case in ("sp-length-not-divisible", "sp-length-not-divisible-unverified")],
        pytest.param(
            "tp-ranks-read-different-data",
            ["ValueError: The tensor-parallel ranks [1] received different batches at setup",
             "Make the dataset identical on every rank"],
            id="tp-ranks-read-different-data",
        ),
        pytest.param(
            "resume-another-model",
            ["ValueError: The checkpoint", "does not fit this module: Size mismatch", "resume with the model it was saved from"],
            id="resume-a-checkpoint-of-another-model",
        ),
        pytest.param(
            "cp-ulysses-heads",
            ["ValueError: `context_parallel_mode='ulysses'` with `context_parallel=2` needs the attention heads",
             "an attention has 3 heads", "Use `context_parallel_mode='ring'`"],
            id="cp-ulysses-heads-not-divisible",
        ),
        pytest.param(
            "cp-eager-attention",
            ["ValueError: Context parallelism does not reproduce block `model.transformer.h.0` (GPT2Block)",
             "No `F.scaled_dot_product_attention` call was seen in it", 'attn_implementation="sdpa"'],
            id="cp-attention-that-cannot-be-split",
        ),
        pytest.param(
            "cp-moe-capacity",
            ["ValueError: `context_parallel=2` with the MoE layer `model.transformer.h.0.mlp` (capacity_factor=1.0)",
             "Use `capacity_factor=None` (dropless)"],
            id="cp-moe-with-capacity-drops",
        ),
        pytest.param(
            "pp-manual-optimization",
            ["ValueError: HybridParallelStrategy(pipeline_parallel=2) runs each training step as a pipeline schedule",
             "manual optimization", "Use automatic optimization, or pipeline_parallel=1"],
            id="pp-with-manual-optimization",
        ),
        pytest.param(
            "dp-ranks-with-unequal-batches",
            ["ValueError: The ranks train on different numbers of batches per epoch (rank 0: 2, rank 1: 3)",
             "Let Lightning place a DistributedSampler"],
            id="dp-ranks-with-unequal-batches",
        ),
        pytest.param(
            "pp-last-batch-smaller",
            ["ValueError: Pipeline parallelism: each epoch's last training batch holds 2 samples", "drop_last=True"],
            id="pp-last-batch-smaller-than-the-others",
        ),
        pytest.param(
            "resume-not-a-checkpoint",
            ["ValueError: `Trainer.fit(ckpt_path=...)`:", "is not a checkpoint torch can read"],
            id="resume-from-a-file-that-is-not-a-checkpoint",
        ),
        pytest.param(
            "pp-step-calls-model-twice",
            ["PipelineSetupError: During one training step the blocks", "not once each in order",
             "must call the model's forward once"],
            id="pp-training-step-calls-the-model-twice",
        ),
    ],
)  # fmt: skip
def test_unusable_plan_fails_on_every_rank(case: str, fragments: list[str], tmp_path: Path) -> None:
    result = launch("bad_plan.py", [case, str(tmp_path)], tmp_path, timeout_s=120, grace_s=20)
    for rank in result.ranks:
        assert not rank.killed, f"rank {rank.rank} had to be killed (it hung):\n{result.summary()}"
        assert rank.returncode not in (0, None), f"rank {rank.rank} did not fail:\n{result.summary()}"
        assert not rank.leftover, f"rank {rank.rank} left a process behind:\n{result.summary()}"
        for fragment in fragments:
            assert fragment in rank.output, f"rank {rank.rank}: {fragment!r} missing:\n{result.summary()}"
        assert "fit finished" not in rank.output
        assert "timed out" not in rank.output.lower(), (
            f"rank {rank.rank} waited for a peer:\n{result.summary()}"
        )


# ZeRO on DeepSpeed's engine under expert parallelism shards over each expert's replicas only:
# with as many expert ranks as data-parallel ranks it would shard nothing (found by the engagement
# record: ZeRO-1 x cp x ep ran with every rank holding every fp32 element).
REFUSED_SHARDING_NOTHING = [
    refusal(("zero1", "ep"), dict(zero_stage=1, expert_parallel=2),
            "`zero_stage=1` with `expert_parallel=2` on 2 data-parallel ranks would shard nothing", world_size=2),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "message"), REFUSED_SHARDING_NOTHING)
def test_zero_that_would_shard_nothing_fails_in_the_trainer_constructor(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        L.Trainer(accelerator="cpu", devices=2, strategy=HybridParallelStrategy(**kwargs), logger=False)
    assert message in str(info.value) and "Use `zero_stage=2` or 3" in str(info.value)
    # More data-parallel ranks than expert ranks: the experts' replicas exist, ZeRO-1 shards over them.
    L.Trainer(accelerator="cpu", devices=4, strategy=HybridParallelStrategy(**kwargs), logger=False)
