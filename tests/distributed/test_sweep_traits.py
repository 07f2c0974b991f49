"""Families of the sweep (``tools/hf_sweep.py``) that each needed a way of sharding attention of its own,
one per trait, unchanged from their tiny configs, at fp32 parity with one process under tp=2:

- CodeGen: a fused q|v|k cut into a constant number of groups (``mp_num``) whatever the local width: each
  rank stores its heads' rows in that many groups (``4 groups of q|k|v``);
- DiffLlama: differential attention pairs head ``i`` with head ``i + heads / 2``: each rank holds its block
  of each half (``heads paired across halves``);
- MPT: ALiBi made at model level as a ``(heads, 1, positions)`` tensor, cut to the rank's heads;
- Kolibri: layer 3 reuses the keys and values layer 1 stored in a dict every layer receives; the sharded layer 1
  stores its own heads only, so the verification checks layer 3 on those (``verify.stored_by_sharded_blocks``);
- Gemma 3n: its MLP keeps the hidden units above a cutoff made from their mean and standard deviation
  (activation sparsity), statistics over every rank's units: they are gathered after the entries and cut again
  at the exit (``MLP hidden units gathered``);
- RecurrentGemma: a rotary child of the attention holds as many frequencies as there are heads (they stay
  whole); ERGO: its shared expert normalises its exit's output with a norm as wide as its hidden units
  (normalised whole); Moshi: each projection wrapped in a module of its own (found through it); Doge: a
  projection of the heads' values to one output per head, as wide as the hidden state (fed the slice); their
  checks are unit tests (``tests/plans/test_attention_parts.py``,
  ``tests/tensor_parallel/test_gathered_norm.py``);
- GPT-NeoX-Japanese: the last block's attention returns its ``dense_bias``, added after the exit's
  reduction: its gradient is the whole one on every rank, not a share; under sequence parallelism (also
  here) the caller adds it on its sequence slice, and the gradient is a share again;
- Jamba under tp=2 with sequence parallelism: its Mamba mixers stay whole and run on the whole sequence
  (gathered entering, sliced leaving: ``tensor_parallel/regions.py: install_whole_sequence``); the negative
  control runs them on the rank's slice;
- OPT under tp=2 with sequence parallelism: its MLP's ``fc1`` and ``fc2`` are the layer's own, so the layer is
  the MLP container; the layer's input stays the rank's slice of the sequence and ``fc1`` gathers what it
  reads, which OPT flattens to ``(tokens, width)`` before the norm (cut along the tokens,
  ``tensor_parallel/norm_styles.py: ResidualNorm``); a negative control for each;
- CTRL under tp=2 with sequence parallelism: its attention takes the hidden state as its values, keys and
  queries, each gathered (``regions.replace_repeated_hidden``); the negative control gathers the first only;
- Doge under tp=2 with sequence parallelism: its layers' own ``input_residual`` and ``post_attention_residual``
  scale the residual on each rank's slice: their gradients, each rank's share, are summed over tp
  (``plans/left_whole.py: sum_shares_over_tp``); the negative control keeps the shares.

Under ep=2 (over both data-parallel ranks): LongCat-Flash, whose router scores two zero experts beyond its
four (the block maps them onto real experts with weight 0), and Zaya, whose router is a small network of
linears with a skip expert: both found by the expert count their router declares; DBRX, whose experts are
2-D stacks of row blocks one level down, sliced by blocks; Llama 4, whose block weighs each token by its
sigmoid score before the experts (only each token's selected rows travel; ``experts/prescaled.py``); JetMoE,
whose MLP and mixture of attention heads call expert linears on rows grouped by expert
(``experts/grouped_linear.py``).
``tests/experts/test_foreign.py`` holds the detection's and the checks' negative controls.

Under pp=2: Kolibri, whose layer 3 reuses the keys and values layer 1 stored in a dict every layer receives
(``shared_kv_states``, ``kv_source_layers=[0, 1, 2, 1]``): the balanced cut before layer 2 moves to layer 1 so
that the pair runs on one stage (``pipeline/handed_state.py``). The negative control of the pairs is
``tests/pipeline/test_stages.py``.

Each tp case's record shows the mode the verification chose; each negative control takes that way away
(``tests/distributed/plan_switches.py``) and the family is refused at setup by the block verification.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES as REGISTERED
from tests.distributed.cases import Case, StrategySpec, register
from tests.distributed.harness import Result, assert_parity, launch_fails, reference, run_cases

pytestmark = [pytest.mark.distributed]

# family -> (the mode its record must show, or None; the switch that takes its way of sharding away)
TRAITS = {
    "codegen": ("fused entry 4 groups of q|k|v", "grouped_qkv"),
    "kolibri1_1": (None, "stored_heads"),
    "gemma3n_text": ("MLP hidden units gathered", "gathered_hidden_units"),
    "diffllama": ("heads paired across halves", "paired_heads"),
    "mpt": ("per-head inputs cut to the local heads", "heads_first_bias"),
    "gpt_neox_japanese": (None, "returned_parameters"),
}


def _case(
    family: str, switch_off: str | None = None, *, sequence_parallel: bool = False, experts: bool = False
) -> Case:
    layout = "ep2" if experts else "tp2" + ("_sp" if sequence_parallel else "")
    name = f"sweep_trait_{family}_{layout}" + (f"_without_{switch_off}" if switch_off else "")
    if name in REGISTERED:
        return REGISTERED[name]
    kwargs: dict = (
        {"expert_parallel": 2} if experts else {"tensor_parallel": 2, "sequence_parallel": sequence_parallel}
    )
    spec = StrategySpec("lightning_parallel:HybridParallelStrategy", {**kwargs, "timeout": 60})
    case = Case(name, "hf_tiny", spec, world_size=2, data_parallel=2 if experts else 1, steps=3,
                model_kwargs={"model_type": family}, switch_off=switch_off)  # fmt: skip
    return register(case)[0]


CASES = [_case(family) for family in TRAITS]
SHARED_KV_PP = register(
    Case("sweep_trait_kolibri1_1_pp2", "hf_tiny",
         StrategySpec("lightning_parallel:HybridParallelStrategy", {"pipeline_parallel": 2, "timeout": 60}),
         world_size=2, data_parallel=1, steps=3, batch_size=4, model_kwargs={"model_type": "kolibri1_1"})
)[0]  # fmt: skip
SIZE_COINCIDENCES = {family: _case(family) for family in ("recurrent_gemma", "ergo", "moshi", "doge")}
RETURNED_UNDER_SP = _case("gpt_neox_japanese", sequence_parallel=True)
WHOLE_UNDER_SP = _case("jamba", sequence_parallel=True)
BLOCK_MLP_UNDER_SP = _case("opt", sequence_parallel=True)
REPEATED_HIDDEN_UNDER_SP = _case("ctrl", sequence_parallel=True)
BLOCK_SCALARS_UNDER_SP = _case("doge", sequence_parallel=True)
EXPERTS = {
    family: _case(family, experts=True)
    for family in ("longcat_flash", "zaya", "dbrx", "llama4_text", "jetmoe")
}


@pytest.fixture(scope="module")
def two_process() -> dict[str, Result]:
    everything = [
        *CASES, RETURNED_UNDER_SP, WHOLE_UNDER_SP, BLOCK_MLP_UNDER_SP, REPEATED_HIDDEN_UNDER_SP,
        BLOCK_SCALARS_UNDER_SP, *EXPERTS.values(),
        *SIZE_COINCIDENCES.values(), SHARED_KV_PP,
    ]  # fmt: skip
    return run_cases(everything, 2, timeout_s=600, references_for=everything)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(TRAITS))
def test_the_family_trains_like_one_process_under_tp2(two_process: dict[str, Result], family: str) -> None:
    case = CASES[list(TRAITS).index(family)]
    result = two_process[case.name]
    assert_parity(result, reference(case))
    mode, _ = TRAITS[family]
    if mode is not None:
        assert mode in result.engagement["tp_modes"], result.engagement["tp_modes"]
    assert not result.engagement_problems, result.engagement_problems


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(SIZE_COINCIDENCES))
def test_a_family_with_sizes_that_coincide_trains_like_one_process(
    two_process: dict[str, Result], family: str
) -> None:
    result = two_process[SIZE_COINCIDENCES[family].name]
    assert_parity(result, reference(SIZE_COINCIDENCES[family]))
    assert not result.engagement_problems, result.engagement_problems


@pytest.mark.timeout(900)
def test_a_returned_parameter_under_sequence_parallelism_keeps_a_share(
    two_process: dict[str, Result],
) -> None:
    assert_parity(two_process[RETURNED_UNDER_SP.name], reference(RETURNED_UNDER_SP))


@pytest.mark.timeout(900)
def test_a_mixer_left_whole_runs_on_the_whole_sequence_under_sequence_parallelism(
    two_process: dict[str, Result],
) -> None:
    result = two_process[WHOLE_UNDER_SP.name]
    assert_parity(result, reference(WHOLE_UNDER_SP))
    assert "modules left whole run on the whole sequence" in result.engagement["tp_modes"]
    assert not result.engagement_problems, result.engagement_problems


@pytest.mark.timeout(900)
def test_a_block_that_is_its_own_mlp_trains_like_one_process_under_sequence_parallelism(
    two_process: dict[str, Result],
) -> None:
    assert_parity(two_process[BLOCK_MLP_UNDER_SP.name], reference(BLOCK_MLP_UNDER_SP))
    assert not two_process[BLOCK_MLP_UNDER_SP.name].engagement_problems


@pytest.mark.timeout(900)
def test_an_attention_given_the_hidden_state_three_times_trains_like_one_process_under_sequence_parallelism(
    two_process: dict[str, Result],
) -> None:
    assert_parity(two_process[REPEATED_HIDDEN_UNDER_SP.name], reference(REPEATED_HIDDEN_UNDER_SP))


@pytest.mark.timeout(900)
def test_a_block_s_own_scalars_sum_their_shares_under_sequence_parallelism(
    two_process: dict[str, Result],
) -> None:
    assert_parity(two_process[BLOCK_SCALARS_UNDER_SP.name], reference(BLOCK_SCALARS_UNDER_SP))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(EXPERTS))
def test_the_family_trains_like_one_process_under_ep2(two_process: dict[str, Result], family: str) -> None:
    result = two_process[EXPERTS[family].name]
    assert_parity(result, reference(EXPERTS[family]))
    assert result.engagement["expert_parameters"] > 0
    assert not result.engagement_problems, result.engagement_problems


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(TRAITS))
def test_negative_control_without_its_way_of_sharding_the_family_is_refused(family: str) -> None:
    _, switch = TRAITS[family]
    with launch_fails("does not reproduce the unsharded block"):
        run_cases([_case(family, switch)], 2, timeout_s=180)


@pytest.mark.timeout(900)
def test_a_layer_reusing_an_earlier_layers_keys_and_values_trains_like_one_process_under_pp2(
    two_process: dict[str, Result],
) -> None:
    result = two_process[SHARED_KV_PP.name]
    assert_parity(result, reference(SHARED_KV_PP))
    assert not result.engagement_problems, result.engagement_problems


# family -> the switch that takes its way of running under sequence parallelism away (plan_switches.py)
SEQUENCE_PARALLEL_WAYS = [
    ("jamba", "whole_sequence"),  # the mixers on the rank's slice
    ("opt", "block_entry_gathers"),  # the layer that is its own MLP gathered at the layer
    ("opt", "flattened_norm"),  # the flattened norm cut along the features
    ("ctrl", "repeated_hidden"),  # only the first of the three hidden-state arguments gathered
    ("doge", "block_shares"),  # each rank's share of the residual scalars' gradients kept
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "switch"), SEQUENCE_PARALLEL_WAYS)
def test_negative_control_under_sequence_parallelism_without_its_way_the_family_is_refused(
    family: str, switch: str
) -> None:
    with launch_fails("does not reproduce the unsharded block"):
        run_cases([_case(family, switch, sequence_parallel=True)], 2, timeout_s=180)
