"""Gradient compression (bytes counted, loss effect bounded) and Adafactor under tp=2: one 2-rank launch.

The launch (``tests/memory/scripts/comm_and_optim.py``) trains through the real Trainer and
writes what it measured; the assertions are here. Bytes are the payloads handed to each
all-reduce (per process): the uncompressed DDP reducer sends every gradient once per step
(``gradient_bytes``), bf16 half of that, PowerSGD at rank r ``(n + m) r`` numbers per
compressed n x m matrix plus the uncompressed vectors and small matrices. Each compressed run
stays within the bound its recorded compression error allows from the uncompressed run
(tests/memory/compression_bound.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel import PowerSGD
from lightning_parallel.comm import powersgd_payload_bytes
from tests.memory.compression_bound import SMOOTHNESS_SAFETY, deviation_bounds, loss_bounds, step_errors
from tests.memory.powersgd_oracle import compression_problems, simulate
from tests.strategy import launch

pytestmark = [pytest.mark.distributed]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "comm_and_optim.py"
# A bf16 all-reduce rounds each rank's gradient (<= 2^-9 relative), then the sum (<= 2^-9 more).
BF16_ALL_REDUCE_ERROR = 2**-8


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("comm_and_optim")
    result = launch(str(SCRIPT), [str(out)], out, timeout_s=400, grace_s=30)
    result.assert_all_succeeded()
    print(f"launch: {result.wall_s:.1f} s")
    return {**json.loads((out / "result.json").read_text()), "_dir": str(out)}


@pytest.mark.timeout(600)
def test_bf16_gradient_all_reduce_sends_half_the_bytes(measured: dict) -> None:
    runs, gradient = measured["gradient_compression"], measured["gradient_compression"]["gradient_bytes"]
    other = runs["none"]["bytes"]  # Python all-reduces outside the gradient sync (Lightning's, at step 0)
    assert [b - o for b, o in zip(runs["bf16"]["bytes"], other, strict=True)] == [gradient // 2] * len(other)
    assert all(run["replicas_agree"] for name, run in runs.items() if name != "gradient_bytes" and isinstance(run, dict)
               and "replicas_agree" in run)  # fmt: skip
    plain, compressed = runs["none"]["losses"], runs["bf16"]["losses"]
    assert compressed[0] == plain[0]
    for step in range(1, len(plain)):  # the bound of tests/distributed/test_parity_memory.py, eps = 2^-8
        bound = BF16_ALL_REDUCE_ERROR * 4 * step * (step + 1) / 2 * abs(plain[0] - plain[1]) + 1e-5 * abs(
            plain[step]
        )
        assert abs(compressed[step] - plain[step]) <= bound, (step, compressed[step], plain[step], bound)


@pytest.mark.timeout(600)
def test_powersgd_sends_the_low_rank_factors_after_its_warm_up(measured: dict) -> None:
    runs = measured["gradient_compression"]
    gradient, other = runs["gradient_bytes"], runs["none"]["bytes"]
    shapes = [torch.Size(s) for s in runs["gradient_shapes"]]
    config = PowerSGD(rank=2, start_iter=2)
    sent = [b - o for b, o in zip(runs["powersgd"]["bytes"], other, strict=True)]
    compressed = powersgd_payload_bytes(shapes, config)
    print(
        f"\nPowerSGD rank 2: {compressed} bytes per step against {gradient} ({gradient / compressed:.1f}x less)"
    )
    assert sent == [gradient, gradient] + [compressed] * (len(sent) - 2)
    assert compressed < gradient / 10
    # Plain all-reduce for start_iter steps: identical to the uncompressed run until then.
    assert runs["powersgd"]["losses"][:3] == runs["none"]["losses"][:3]
    assert runs["powersgd"]["replicas_agree"]


@pytest.mark.timeout(600)
def test_pipeline_all_reduce_compression(measured: dict) -> None:
    bf16, powersgd = measured["pipeline_all_reduce"]["bf16"], measured["pipeline_all_reduce"]["powersgd"]
    shapes = [torch.Size(s) for s in bf16["shapes"]]
    numel = sum(s.numel() for s in shapes)
    assert bf16["bytes"] == [numel * 2] * 4
    assert max(bf16["errors"]) <= BF16_ALL_REDUCE_ERROR
    config = PowerSGD(rank=2, start_iter=2)
    assert powersgd["bytes"] == [numel * 4] * 2 + [powersgd_payload_bytes(shapes, config)] * 2
    assert powersgd["errors"][:2] == [0.0, 0.0]  # warm-up steps are exact means


@pytest.mark.timeout(600)
def test_adafactor_steps_tensor_parallel_parameters_like_one_process(measured: dict) -> None:
    run = measured["adafactor_tp2"]
    for step, (got, want) in enumerate(zip(run["losses"], run["reference_losses"], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert (
        run["state_bytes_rank0"] < run["reference_state_bytes"]
    )  # the factors of sharded weights are sharded


def _calls(measured: dict) -> dict[str, list[list[dict]]]:
    return torch.load(Path(measured["_dir"]) / "hook_calls.pt", weights_only=False)


ORACLE_CONFIGS = {"bf16": torch.bfloat16, "powersgd": PowerSGD(rank=2, start_iter=2)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ["ddp", "pipeline"])
@pytest.mark.parametrize("compression", sorted(ORACLE_CONFIGS))
def test_compressed_all_reduce_equals_a_one_process_simulation(
    measured: dict, path: str, compression: str
) -> None:
    """Every bucket each rank's hook returned, warm-up and compressed steps, equals torch's hook run for two
    virtual ranks in one process on the same inputs (tests/memory/powersgd_oracle.py), within fp32 tolerance."""
    ranks = _calls(measured)[f"{path}_{compression}"]
    assert len(ranks) == 2 and ranks[0], "no hook call was recorded: the compression did not engage"
    assert compression_problems(ORACLE_CONFIGS[compression], ranks) == []
    # Engaged: after PowerSGD's warm-up the result is no longer the exact mean of the ranks' inputs.
    exact = [(a["before"] + b["before"]) / 2 for a, b in zip(*ranks, strict=True)]
    off = [float((c["after"] - e).norm() / e.norm()) for c, e in zip(ranks[0], exact, strict=True)]
    if compression == "powersgd":
        assert min(off) < 1e-6 and max(off) > 1e-2, off  # exact while warming up, then an approximation
    else:
        assert 0 < max(off) <= BF16_ALL_REDUCE_ERROR, off


@dataclass(frozen=True)
class _WithoutErrorFeedback(PowerSGD):
    """PowerSGD that forgets what each approximation left out (a negative control)."""

    def state(self, group: Any) -> Any:
        state = super().state(group)
        state.use_error_feedback = False
        return state


@pytest.mark.timeout(600)
@pytest.mark.parametrize("corruption", ["zeros", "no_error_feedback", "halved"])
def test_a_wrong_compressor_fails_the_simulation_check(measured: dict, corruption: str) -> None:
    """Negative controls: a PowerSGD returning zeros, one that lost its error feedback, a wrong divisor."""
    config = ORACLE_CONFIGS["powersgd"]
    ranks = _calls(measured)["ddp_powersgd"]
    if corruption == "no_error_feedback":  # what the run would have returned without the error memory
        wrong = simulate(_WithoutErrorFeedback(rank=config.rank, start_iter=config.start_iter), ranks)
        ranks = [
            [{**c, "after": w} for c, w in zip(calls, out, strict=True)]
            for calls, out in zip(ranks, wrong, strict=True)
        ]
    else:
        factor = 0.0 if corruption == "zeros" else 0.5
        ranks = [[{**c, "after": c["after"] * factor} for c in calls] for calls in ranks]
    assert compression_problems(config, ranks)


LR, MOMENTUM = 0.1, 0.9  # the families' SGD (tests/models/optim.py)
COMPRESSED_RUNS = {"powersgd": True, "bf16": False}  # run -> error feedback


def _drift(measured: dict, run: str, feedback: bool) -> dict[str, Any]:
    """The run's distance from the uncompressed run per step, and the bound its compression error allows."""
    trajectories = torch.load(Path(measured["_dir"]) / "trajectories.pt", weights_only=False)
    plain, compressed = trajectories["ddp_none"], trajectories[f"ddp_{run}"]
    errors = step_errors(_calls(measured)[f"ddp_{run}"], feedback)
    smoothness = SMOOTHNESS_SAFETY * max(compressed["curvatures"])
    bounds = deviation_bounds(errors, smoothness, LR, MOMENTUM, feedback)
    gradients = [float(g.norm()) for g in plain["grads"]]
    return {
        "errors": errors,
        "bounds": bounds,
        "distance": [float((x - u).norm()) for x, u in zip(compressed["params"], plain["params"], strict=True)],
        "slack": [1e-6 * float(u.norm()) for u in plain["params"]],  # fp32: the runs' own rounding
        "loss_gap": [abs(a - b) for a, b in zip(compressed["losses"], plain["losses"], strict=True)],
        "loss_bounds": [b + 1e-5 * abs(loss) for b, loss in zip(loss_bounds(bounds, gradients, smoothness),
                                                                  plain["losses"], strict=True)],
        "movement": float((plain["params"][-1] - plain["params"][0]).norm()),
        "smoothness": smoothness,
    }  # fmt: skip


def _drift_problems(drift: dict[str, Any]) -> list[str]:
    problems = [
        f"parameters before step {t}: {d:.3g} from the uncompressed run, bound {b:.3g}"
        for t, (d, b, s) in enumerate(zip(drift["distance"], drift["bounds"], drift["slack"], strict=True))
        if not d <= b + s
    ]
    return problems + [
        f"loss of step {t}: {gap:.3g} from the uncompressed run, bound {b:.3g}"
        for t, (gap, b) in enumerate(zip(drift["loss_gap"], drift["loss_bounds"], strict=True))
        if not gap <= b
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", sorted(COMPRESSED_RUNS))
def test_compressed_training_stays_within_the_bound_of_its_compression_error(
    measured: dict, run: str
) -> None:
    """The compressed run's parameters and losses, every step, within what its recorded compression error and
    the loss's measured smoothness allow from the uncompressed run (tests/memory/compression_bound.py)."""
    drift = _drift(measured, run, COMPRESSED_RUNS[run])
    print(
        f"\n{run}: errors {[f'{e:.2g}' for e in drift['errors']]}; distance {[f'{d:.2g}' for d in drift['distance']]}"
        f" <= bound {[f'{b:.2g}' for b in drift['bounds']]} (movement {drift['movement']:.3g}, L {drift['smoothness']:.3g});"
        f" loss gap {[f'{g:.2g}' for g in drift['loss_gap']]} <= {[f'{b:.2g}' for b in drift['loss_bounds']]}"
    )  # fmt: skip
    assert max(drift["errors"]) > 0 and max(drift["distance"]) > 0, "the compression did not engage"
    assert _drift_problems(drift) == []
    # The bound says something: it is a fraction of how far the uncompressed run moved.
    assert drift["bounds"][-1] < drift["movement"] / 2, (drift["bounds"], drift["movement"])


@pytest.mark.timeout(600)
def test_an_error_outside_the_compressor_breaks_the_drift_bound(measured: dict) -> None:
    """Negative control: PowerSGD whose second MLP gradient is doubled after the reduction, from step 2 on."""
    drift = _drift(measured, "powersgd_misapplied", True)
    assert _drift_problems(drift)
