"""The CPU stand-ins for what a GPU would show: host copies counted (``tests/sync_counter.py``) and host tensors
marked (``tests/device_guard.py``) wherever the project's code spells the CPU, and only there.

The project's code is stood in for by functions compiled under a ``lightning_parallel`` file name (both tools
charge only frames of the package), with their source in ``linecache`` as an imported module's would be.
No process group.
"""

from __future__ import annotations

import linecache

import torch

from tests.device_guard import HostMarking, is_host_tensor
from tests.sync_counter import SyncCounter

FILENAME = "/stand-in/lightning_parallel/host_copies.py"
SOURCE = """
import torch

CPU = torch.device("cpu")


def to_spelled_device(x):
    return x.to(torch.device("cpu"))


def to_spelled_string(x):
    return x.to("cpu")


def to_module_constant(x):
    return x.to(CPU)


def to_parameter_device(x, weight):
    return x.to(weight.device)


def factory_on_spelled_device():
    return torch.zeros(2, device=torch.device("cpu"))


def factory_on_parameter_device(weight):
    return torch.zeros(2, device=weight.device)
"""


def _project() -> dict:
    linecache.cache[FILENAME] = (len(SOURCE), None, SOURCE.splitlines(keepends=True), FILENAME)
    namespace: dict = {"__name__": "lightning_parallel.host_copies"}
    exec(compile(SOURCE, FILENAME, "exec"), namespace)
    return namespace


def _host_copies(call) -> int:  # noqa: ANN001
    counter = SyncCounter()
    with counter.counting():
        call()
    return sum(n for (kind, _), n in counter.counts.items() if kind == "host copy")


def test_a_host_copy_is_counted_however_the_cpu_is_spelled() -> None:
    project = _project()  # a fresh tensor each time: ``.to`` on the CPU returns it, marked as on the host
    # was missed: the CPU as a torch.device object
    assert _host_copies(lambda: project["to_spelled_device"](torch.ones(3))) == 1
    assert _host_copies(lambda: project["to_spelled_string"](torch.ones(3))) == 1
    assert _host_copies(lambda: project["to_module_constant"](torch.ones(3))) == 1


def test_a_copy_to_a_parameters_device_is_not_a_host_copy() -> None:
    """Negative control: on a GPU ``weight.device`` is the GPU; on the CPU it reads ``cpu`` all the same."""
    project = _project()
    weight = torch.nn.Parameter(torch.ones(2))
    assert _host_copies(lambda: project["to_parameter_device"](torch.ones(3), weight)) == 0
    assert _host_copies(lambda: torch.ones(3).to(torch.device("cpu"))) == 0  # not the project's code


def test_host_tensors_are_marked_however_the_cpu_is_spelled() -> None:
    project = _project()
    weight = torch.nn.Parameter(torch.ones(2))
    with HostMarking():
        spelled = project["factory_on_spelled_device"]()
        moved = project["to_spelled_device"](torch.ones(2))
        constant = project["to_module_constant"](torch.ones(2))
        on_weight = project["factory_on_parameter_device"](weight)
        moved_to_weight = project["to_parameter_device"](torch.ones(2), weight)
    assert is_host_tensor(spelled) and is_host_tensor(moved) and is_host_tensor(constant)
    assert not is_host_tensor(on_weight) and not is_host_tensor(moved_to_weight)  # negative control
