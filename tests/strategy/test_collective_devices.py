"""No collective of a training run gets a host tensor the project made (NCCL takes only CUDA tensors).

Two ranks over gloo, where every tensor is on the CPU and such a mistake passes silently; the guard
(``tests/device_guard.py``) marks the tensors the project's code puts on the host and checks every
collective's arguments during fit, validation and a checkpoint save, in each layout of
``tests/strategy/scripts/collective_devices.py`` (tp, pp, ep with its data-parallel buckets, cp ring and
Ulysses, PowerSGD, ZeRO on DeepSpeed's engine and on FSDP2). Negative controls: the vote helper's flag made on
the default device is reported, at its line; ``tests/test_host_counters.py``: every spelling of the host
(``torch.device("cpu")`` included) marked, a parameter's device not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.strategy import launch_for_results

pytestmark = [pytest.mark.distributed]


@pytest.mark.timeout(900)
def test_collectives_get_tensors_on_the_communication_device(tmp_path: Path) -> None:
    for rank, measured in enumerate(launch_for_results("collective_devices.py", tmp_path)):
        control = measured.pop("control_host_flag")
        assert any("comm/agreement.py" in where for _, where in control["violations"]), control
        for layout, seen in measured.items():
            assert seen["collectives"] > 10, (rank, layout, seen)  # the layout really communicated
            assert seen["violations"] == [], (rank, layout, seen["violations"])
