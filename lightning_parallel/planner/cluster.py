"""A cluster as data: what one GPU computes and moves per second, and how much of it training reaches.

The time model (``planner/timing.py``) reads every hardware number from a :class:`Cluster`, so a
prediction for another machine is another preset or a YAML file with the same fields, never a code
change. Peaks and bandwidths are the vendors' datasheet figures (dense FLOP/s, not the 2:4-sparse
ones datasheets print first; links counted one direction per GPU). The efficiency factors say how
much of a peak training kernels reach; they are the model's only fitted numbers, one set per chip,
and each preset's ``source`` says where every one of its numbers comes from.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CLUSTERS", "Cluster", "load_cluster"]

GB = 1e9
MIB = 2**20


@dataclass(frozen=True)
class Cluster:
    """One GPU of a cluster and its links; every rate per GPU, in bytes or FLOP per second."""

    name: str
    peak_bf16_flops: float
    """Dense bf16/fp16 tensor-core FLOP/s. ``32-true`` is costed at half of it (TF32, ``micro_batch.py``)."""
    peak_fp8_flops: float
    """Dense fp8 tensor-core FLOP/s (0: the chip has none)."""
    memory_bytes: int
    """Device memory, as ``nvidia-smi`` reports the total."""
    memory_bandwidth: float
    """HBM bytes/s: what normalisations, activations, dropout, softmax and the optimizer step wait on."""
    gpus_per_node: int
    intra_node_bandwidth: float
    """NVLink bytes/s per GPU, one direction (the NVSwitch lets every GPU use all of it at once)."""
    inter_node_bandwidth: float
    """Network bytes/s per GPU, one direction (one NIC per GPU on DGX/HGX nodes)."""
    host_bandwidth: float
    """PCIe bytes/s between a GPU and host memory, one direction."""
    nvme_bandwidth: float
    """NVMe bytes/s a GPU's share of the node's drives reads or writes (ZeRO-Infinity offload)."""
    matmul_efficiency: float
    """Fraction of the dense peak that a training step's matmuls (and fused attention) run at."""
    memory_efficiency: float = 0.8
    """Fraction of the HBM bandwidth memory-bound kernels reach (STREAM-like copies reach 0.8-0.9)."""
    intra_node_efficiency: float = 0.8
    """Fraction of NVLink bandwidth NCCL's large collectives reach (nccl-tests bus bandwidth)."""
    inter_node_efficiency: float = 0.85
    """Fraction of the network's line rate NCCL's large collectives reach across nodes."""
    host_efficiency: float = 0.8
    """Fraction of PCIe bandwidth pinned-memory copies reach."""
    host_adam_throughput: float = 3.5e9
    """Parameters/s the host updates with DeepSpeed's vectorised CPU Adam, for one GPU's share of the cores."""
    source: str = ""
    """Where each number comes from."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in ("name", "source"):
                continue
            zero_allowed = item.name == "peak_fp8_flops"
            if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero_allowed):
                raise ValueError(f"Cluster {self.name!r}: `{item.name}={value!r}` must be a positive number.")
        for name in (
            "matmul_efficiency",
            "memory_efficiency",
            "intra_node_efficiency",
            "inter_node_efficiency",
            "host_efficiency",
        ):
            if getattr(self, name) > 1:
                raise ValueError(
                    f"Cluster {self.name!r}: `{name}={getattr(self, name)}` is a fraction of a peak (<= 1)."
                )


_DATASHEETS = (
    "Peaks and bandwidths: NVIDIA A100 datasheet (312 TFLOP/s dense bf16; HBM2 1,555 GB/s for 40 GB, HBM2e"
    " 2,039 GB/s for 80 GB SXM; NVLink 3 600 GB/s both directions), H100 SXM datasheet (989 TFLOP/s dense bf16,"
    " 1,979 fp8; HBM3 3.35 TB/s; NVLink 4 900 GB/s both directions), H200 SXM datasheet (same compute and"
    " NVLink as H100, HBM3e 141 GB at 4.8 TB/s), HGX/DGX B200 datasheets (2.25 PFLOP/s dense bf16, 4.5 fp8,"
    " HBM3e 8 TB/s, NVLink 5 1.8 TB/s both directions). Network: DGX A100 one 200 Gb/s HDR NIC per GPU,"
    " DGX H100/H200/B200 one 400 Gb/s NDR NIC per GPU. PCIe: gen4 x16 (32 GB/s) on A100, gen5 x16 (64 GB/s)"
    " on the others. NVMe: DGX A100/H100 8 x 3.84 TB U.2 NVMe drives, about 25 GB/s read for the node."
    " Memory: the total nvidia-smi prints (MiB)."
)
_EFFICIENCIES = (
    " Efficiencies: memory 0.8 (elementwise kernels reach 80-90% of HBM bandwidth), NVLink 0.8 and network"
    " 0.85 (nccl-tests bus bandwidth against the line rate), PCIe 0.8 (pinned copies), host Adam 3.5e9"
    " parameters/s (measured on the lent H200 machine: DeepSpeed ZeRO-2 with DeepSpeedCPUAdam adds 576 ms"
    " to a GPT-1.3B step (ANCHORS.md of the project's shared reference, not shipped); less 0.21 s of fp32 gradients down and"
    " parameters up over PCIe, 1.32e9 parameters in 0.37 s)."
)


def _a100(name: str, memory_mib: int, bandwidth: float) -> Cluster:
    return Cluster(
        name=name,
        peak_bf16_flops=312e12,
        peak_fp8_flops=0.0,
        memory_bytes=memory_mib * MIB,
        memory_bandwidth=bandwidth,
        gpus_per_node=8,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        host_bandwidth=32 * GB,
        nvme_bandwidth=3 * GB,
        matmul_efficiency=0.73,
        source=_DATASHEETS
        + _EFFICIENCIES
        + " Matmul 0.73: fitted once to the whole PTD-P Table 1 (Narayanan et al. 2021, Selene A100 80 GB;"
        " planner/published.py), the same for every A100 row.",
    )


def _hopper(name: str, memory_mib: int, bandwidth: float, matmul: float, why: str) -> Cluster:
    """H100 and H200 SXM: the same compute, NVLink and DGX network; more and faster memory on the H200."""
    return Cluster(
        name=name,
        peak_bf16_flops=989.4e12,
        peak_fp8_flops=1978.9e12,
        memory_bytes=memory_mib * MIB,
        memory_bandwidth=bandwidth,
        gpus_per_node=8,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        host_bandwidth=64 * GB,
        nvme_bandwidth=3 * GB,
        matmul_efficiency=matmul,
        source=_DATASHEETS + _EFFICIENCIES + why,
    )


_H100_MATMUL = 0.58
_H200_MATMUL = 0.75
CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        _a100("a100-40gb", 40_960, 1555 * GB),
        _a100("a100-80gb", 81_920, 2039 * GB),
        _hopper(
            "h100",
            81_559,
            3350 * GB,
            _H100_MATMUL,
            f" Matmul {_H100_MATMUL}: fitted once to the whole Megatron-LM README H100 table (Megatron-Core"
            " r0.8.0, 2024; planner/published.py), the same for every row. Lower than the A100's and the"
            " H200's: those runs overlap every collective with compute, which the model counts as free, so"
            " what the overlapped collectives take from the matmuls (SMs, HBM) lands in this factor.",
        ),
        replace(
            _hopper(
                "h100-hbm2e-500w",
                91_553,  # 96 GB as stated (nvidia-smi's total for this part is not published)
                2400 * GB,
                _H100_MATMUL,
                f" Matmul {_H100_MATMUL}: the H100's. Meta's Grand Teton H100 (torchtitan's benchmarks): 96 GB of HBM2e"
                " at 2.4 TB/s, 500 W. torchtitan: its peak 'is between SXM and NVL, and we don't know its exact value':"
                " the midpoint of the H100 SXM's 989 and the H100 NVL's 835 TFLOP/s dense bf16 (1,979 and 1,671 fp8).",
            ),
            peak_bf16_flops=912e12,
            peak_fp8_flops=1825e12,
        ),
        _hopper(
            "h200",
            143_771,
            4800 * GB,
            _H200_MATMUL,
            f" Matmul {_H200_MATMUL}: fitted to the lent H200's GPT-1.3B step (bf16-mixed, batch 8 x 2048,"
            " plain PyTorch eager: 282.7 ms, ANCHORS.md); an isolated 8192^3 bf16 matmul reaches 0.81.",
        ),
        Cluster(
            name="b200",
            peak_bf16_flops=2250e12,
            peak_fp8_flops=4500e12,
            memory_bytes=183_359 * MIB,
            memory_bandwidth=8000 * GB,
            gpus_per_node=8,
            intra_node_bandwidth=900 * GB,
            inter_node_bandwidth=50 * GB,
            host_bandwidth=64 * GB,
            nvme_bandwidth=3 * GB,
            matmul_efficiency=_H200_MATMUL,
            source=_DATASHEETS
            + _EFFICIENCIES
            + f" Matmul {_H200_MATMUL}: assumed the H200's; no B200 run was checked.",
        ),
        Cluster(
            name="gb200",
            peak_bf16_flops=2500e12,
            peak_fp8_flops=5000e12,
            memory_bytes=186 * 1000**3,
            memory_bandwidth=8000 * GB,
            gpus_per_node=72,
            intra_node_bandwidth=900 * GB,
            inter_node_bandwidth=50 * GB,
            host_bandwidth=450 * GB,
            nvme_bandwidth=3 * GB,
            matmul_efficiency=_H200_MATMUL,
            source="GB200 NVL72: NVIDIA's figures for the GB200 variant of the Blackwell GPU at 1,200 W (2.5 PFLOP/s"
            " dense bf16, 5 fp8; HBM3e 8 TB/s), 13.4 TB of HBM3e over the rack's 72 GPUs (186 GB a GPU), one NVLink 5"
            " domain of 72 GPUs (900 GB/s each way a GPU), one 400 Gb/s NIC a GPU between racks, NVLink-C2C to the"
            " Grace CPU (900 GB/s both ways)."
            + _EFFICIENCIES
            + f" Matmul {_H200_MATMUL}: assumed the H200's; no GB200 run was checked.",
        ),
    )
}


_INTEGERS = ("memory_bytes", "gpus_per_node")


def _number(name: str, value: Any) -> Any:
    """YAML reads ``4.5e11`` (no dot, no sign) as a string: numbers are taken in either spelling."""
    if isinstance(value, str) and name not in ("name", "source"):
        try:
            value = float(value)
        except ValueError as error:
            raise ValueError(f"cluster key `{name}: {value!r}` is not a number") from error
    if name in _INTEGERS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset by name (``CLUSTERS``), or a YAML file with :class:`Cluster`'s fields.

    A file may start from a preset with ``base: h100`` and set only the fields that differ;
    without ``base`` every field without a default is required.
    """
    text = str(name_or_path)
    if text.lower() in CLUSTERS:
        return CLUSTERS[text.lower()]
    path = Path(text)
    if path.suffix.lower() not in (".yaml", ".yml") and not path.exists():
        raise ValueError(
            f"Unknown cluster {text!r}: use one of the presets {sorted(CLUSTERS)} or a YAML file path."
        )
    if not path.exists():
        raise ValueError(f"Cluster file {text!r} does not exist (presets: {sorted(CLUSTERS)}).")

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"Cluster file {text!r} must hold a mapping of Cluster fields, not {type(data).__name__}."
        )
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(data) - known - {"base"})
    if unknown:
        raise ValueError(f"Cluster file {text!r}: unknown key(s) {unknown}; the fields are {sorted(known)}.")
    values = {key: _number(key, value) for key, value in data.items() if key != "base"}
    if "base" in data:
        base = str(data["base"]).lower()
        if base not in CLUSTERS:
            raise ValueError(
                f"Cluster file {text!r}: unknown `base: {data['base']}`; presets: {sorted(CLUSTERS)}."
            )
        values.setdefault("name", path.stem)
        values.setdefault("source", f"{CLUSTERS[base].source} Overridden by {path}.")
        return replace(CLUSTERS[base], **values)
    missing = [f.name for f in fields(Cluster) if f.default is MISSING and f.name not in values]
    if missing:
        raise ValueError(
            f"Cluster file {text!r}: missing key(s) {missing} (or start from a preset: `base: h100`)."
        )
    return Cluster(**values)
