"""Families of the sweep (``tools/hf_sweep.py``) that each needed a way of sharding attention of its own,
one per trait, unchanged from their tiny configs, at fp32 parity with one process under tp=2:

- CodeGen: a fused q|v|k cut into a constant number of groups (``mp_num``) whatever the local width: each
  rank stores its heads' rows in that many groups (``4 groups of q|k|v``);
- DiffLlama: differential attention pairs head ``i`` with head ``i + heads / 2``: each rank holds its block
  of each half (``heads paired across halves``);
- MPT: ALiBi made at model level as a ``(heads, 1, positions)`` tensor, cut to the rank's heads;
- GPT-NeoX-Japanese: the last block's attention returns its ``dense_bias``, added after the exit's
  reduction: its gradient is the whole one on every rank, not a share.

Each case's record shows the mode the verification chose; each negative control takes that way away
(``tests/distributed/plan_switches.py``) and the family is refused at setup by the block verification.
"""

from __future__ import annotations

import pytest

from tests.distributed.cases import CASES as REGISTERED
from tests.distributed.cases import Case, StrategySpec, register
from tests.distributed.harness import HarnessError, Result, assert_parity, reference, run_cases

pytestmark = [pytest.mark.distributed]

# family -> (the mode its record must show, or None; the switch that takes its way of sharding away)
TRAITS = {
    "codegen": ("fused entry 4 groups of q|k|v", "grouped_qkv"),
    "diffllama": ("heads paired across halves", "paired_heads"),
    "mpt": ("per-head inputs cut to the local heads", "heads_first_bias"),
    "gpt_neox_japanese": (None, "returned_parameters"),
}


def _case(family: str, switch_off: str | None = None) -> Case:
    name = f"sweep_trait_{family}_tp2" + (f"_without_{switch_off}" if switch_off else "")
    if name in REGISTERED:
        return REGISTERED[name]
    spec = StrategySpec("lightning_parallel:HybridParallelStrategy", {"tensor_parallel": 2, "timeout": 60})
    case = Case(name, "hf_tiny", spec, world_size=2, data_parallel=1, steps=3,
                model_kwargs={"model_type": family}, switch_off=switch_off)  # fmt: skip
    return register(case)[0]


CASES = [_case(family) for family in TRAITS]


@pytest.fixture(scope="module")
def two_process() -> dict[str, Result]:
    return run_cases(CASES, 2, timeout_s=600, references_for=CASES)


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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(TRAITS))
def test_negative_control_without_its_way_of_sharding_the_family_is_refused(family: str) -> None:
    _, switch = TRAITS[family]
    with pytest.raises(HarnessError, match="does not reproduce the unsharded block"):
        run_cases([_case(family, switch)], 2, timeout_s=180)
