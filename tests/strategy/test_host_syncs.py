"""The host syncs per training step the project's code makes stay within the budget docs/gpu.md
states (counted on CPU by ``tests/sync_counter.py``; on a GPU each one stalls the queue):

- tensor parallel: none, with Adafactor on the DTensor parameters too;
- pipeline parallel: none per micro-batch; one per step on the ranks that receive the last stage's
  loss and logs (the header of ``StepLogs``), none on the last stage; one per evaluation step;
- expert parallel: at most three per MoE layer per step, all in forward: the all-to-all's split sizes,
  the token group's total, the assignments kept by capacity; none in backward, none in the data-parallel
  buckets that reduce its dense gradients (``data_parallel/buckets.py``, seen launched);
- ZeRO on DeepSpeed's engine (stage 2) and on FSDP2 (stage 3), context parallelism (ring): none.

Negative controls: a project function that reads sizes to the host is counted; ``tests/test_host_counters.py``:
every spelling of a host copy (``.to(torch.device("cpu"))`` included) counted, a parameter's device not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.strategy import launch_for_results

pytestmark = [pytest.mark.distributed]


@pytest.mark.timeout(900)
def test_host_syncs_per_step_stay_within_the_budget(tmp_path: Path) -> None:
    for rank, measured in enumerate(launch_for_results("host_syncs.py", tmp_path)):
        assert any("experts/experts.py" in where for where in measured.pop("control")), rank
        budgets = {"tp2": 0, "tp2_adafactor": 0, "pp2": 1, "ep2": 3 * measured["ep2"]["moe_layers"],
                   "zero2": 0, "zero3_fsdp2": 0, "cp2_ring": 0}  # fmt: skip
        assert measured["ep2"]["moe_layers"] >= 2
        assert measured["ep2"]["bucket_launches"] > 0, rank  # the dense gradients went through the buckets
        for layout, budget in budgets.items():
            steps = measured[layout]["steps"]
            assert len(steps) == 2, (layout, steps)
            for counted in steps:
                assert sum(counted.values()) <= budget, (rank, layout, counted)
        # The pipeline's one sync is the receiving ranks' header read; none per micro-batch (4 here).
        assert all(sum(c.values()) <= 1 for c in measured["pp2"]["steps"])
        # Evaluation under stages: one per step too, after the first (which sends what is logged once):
        # the logs' header, or the first micro-batch's activation header (was one read per number of it).
        evaluated = measured["pp2"]["eval_steps"]
        assert len(evaluated) >= 2 and all(sum(c.values()) <= 1 for c in evaluated[1:]), (rank, evaluated)
        assert all(sum(c.values()) <= budgets["ep2"] for c in measured["ep2"]["eval_steps"]), rank
        assert all(sum(c.values()) == 0 for c in measured["cp2_ring"]["eval_steps"]), rank
