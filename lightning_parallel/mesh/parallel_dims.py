"""The parallel layout: degrees per mesh axis, their validation, and the one DeviceMesh.

Mesh axes, outermost first (docs/architecture.md, "Mesh axes"):

- ``pp``: pipeline stages. Outermost because stages only exchange activations, so they
  tolerate the slowest links (across nodes).
- ``dp``: data-parallel replicas. Gradients are averaged over it once per optimizer step.
  When experts are sharded it is the product ``dp_replicate x ep``; experts live on ``ep``.
  When sequences are split for context parallelism it is the product ``dp_batch x cp``: the
  ``cp`` ranks of one ``dp_batch`` index read the same batch and hold different tokens of each
  sequence; parameters are replicated over ``cp`` and their gradients averaged with the rest of
  ``dp`` (``context_parallel/split.py`` says why that average is exact). With both, ``dp`` is
  factored both ways (one of ``ep``, ``cp`` divides the other).
- ``tp``: tensor-parallel shards. Innermost, so that the ranks of one tensor-parallel group
  are adjacent global ranks: with ranks placed node by node they share a node (fast links),
  which matters because TP communicates inside every layer.

Every axis exists even when its degree is 1, so code asks ``mesh[Axis.TP]`` without branching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import init_device_mesh

from lightning_parallel.compat import flatten_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Axis(StrEnum):
    """The mesh's axis names (docs/architecture.md, "Mesh axes"): ``mesh[Axis.TP]``. Members are strings,
    so the mesh itself keeps plain names (and so do checkpoints and logs)."""

    PP = "pp"
    DP = "dp"
    TP = "tp"
    EP = "ep"
    CP = "cp"
    DP_REPLICATE = "dp_replicate"  # dp's replicas of each expert shard: dp = dp_replicate x ep
    DP_BATCH = "dp_batch"  # dp's distinct batches: dp = dp_batch x cp
    EP_MID = "ep_mid"  # with both ep and cp: the factor of the larger beside the smaller
    CP_MID = "cp_mid"


def _names(*axes: Axis) -> tuple[str, ...]:
    return tuple(str(axis) for axis in axes)


AXIS_NAMES: tuple[str, ...] = _names(Axis.PP, Axis.DP, Axis.TP)
# With expert parallelism: dp is split into dp_replicate x ep ("dp" is their flattened axis).
EXPERT_AXIS_NAMES: tuple[str, ...] = _names(Axis.PP, Axis.DP_REPLICATE, Axis.EP, Axis.TP)
# With context parallelism: dp is split into dp_batch x cp (the sampler's replicas are dp_batch).
CONTEXT_AXIS_NAMES: tuple[str, ...] = _names(Axis.PP, Axis.DP_BATCH, Axis.CP, Axis.TP)
# With both, the smaller of ep and cp is the inner axis and the larger is it times a middle one
# (``_build_context_and_expert_mesh``); the names used elsewhere are flattened from those.


def _divisors(n: int) -> list[int]:
    """The degrees an axis carved out of ``n`` ranks may take (named in the refusal)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelDims:
    """Degrees of parallelism for one job; ``data_parallel=-1`` means "whatever is left".

    Validation happens on construction so that a bad layout fails on every rank at setup,
    before any collective is issued (a rank that errors inside a collective hangs the rest).
    """

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = -1
    expert_parallel: int = 1
    context_parallel: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "world_size",
            "tensor_parallel",
            "pipeline_parallel",
            "expert_parallel",
            "context_parallel",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}={value!r}` must be a positive integer.")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"`tensor_parallel={self.tensor_parallel}` x `pipeline_parallel={self.pipeline_parallel}`"
                f" = {model_parallel} does not divide the world size {self.world_size}"
                f" (devices x num_nodes). Choose degrees whose product divides {self.world_size},"
                f" or run on a multiple of {model_parallel} devices."
            )
        inferred_dp = self.world_size // model_parallel
        if self.data_parallel == -1:
            self.data_parallel = inferred_dp
        elif self.data_parallel != inferred_dp:
            raise ValueError(
                f"`data_parallel={self.data_parallel}` does not match the world size: {self.world_size} ranks"
                f" / (tensor_parallel={self.tensor_parallel} x pipeline_parallel={self.pipeline_parallel})"
                f" = {inferred_dp}. Leave `data_parallel` unset (-1) to use what is left."
            )
        if self.data_parallel % self.expert_parallel != 0:
            raise ValueError(
                f"`expert_parallel={self.expert_parallel}` must divide the data-parallel size"
                f" {self.data_parallel}: expert ranks are carved out of the data-parallel ranks. Choose"
                f" expert_parallel among {_divisors(self.data_parallel)}."
            )

        if self.data_parallel % self.context_parallel != 0:
            raise ValueError(
                f"`context_parallel={self.context_parallel}` must divide the data-parallel size {self.data_parallel}"
                f" ({self.world_size} ranks / (tensor_parallel={self.tensor_parallel} x pipeline_parallel="
                f"{self.pipeline_parallel})): context ranks are carved out of the data-parallel ranks. Choose"
                f" context_parallel among {_divisors(self.data_parallel)}."
            )
        ep, cp = self.expert_parallel, self.context_parallel
        if ep > 1 and cp > 1 and ep % cp and cp % ep:
            raise ValueError(
                f"`context_parallel={cp}` with `expert_parallel={ep}`: one must divide the other. Both are carved out"
                " of the data-parallel ranks, and the mesh factors them only when the smaller group lies inside the"
                f" larger. Choose `expert_parallel` a multiple or a divisor of {cp}."
            )

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline_parallel > 1

    @property
    def dp_enabled(self) -> bool:
        return self.data_parallel > 1

    @property
    def ep_enabled(self) -> bool:
        return self.expert_parallel > 1

    @property
    def cp_enabled(self) -> bool:
        return self.context_parallel > 1

    @property
    def data_replicas(self) -> int:
        """Ranks that read different batches: ``dp`` without the context ranks (which share theirs)."""
        return self.data_parallel // self.context_parallel

    @property
    def degrees(self) -> dict[str, int]:
        """The sizes of the mesh's axes ``pp``, ``dp``, ``tp`` (``dp`` includes the expert ranks)."""
        return {"pp": self.pipeline_parallel, "dp": self.data_parallel, "tp": self.tensor_parallel}

    @property
    def layout(self) -> dict[str, int]:
        """Every degree that shapes a parallelized module, ``ep`` included: ep=2 and ep=1 on the same
        ranks have the same :attr:`degrees` but shard the experts differently. What a reused module
        and a checkpoint's metadata are compared by."""
        return {
            "pp": self.pipeline_parallel,
            "dp": self.data_parallel,
            "ep": self.expert_parallel,
            "cp": self.context_parallel,
            "tp": self.tensor_parallel,
        }

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create (once) the mesh with every axis named; all ranks must call this together."""

        if self._mesh is None:
            if self.ep_enabled and self.cp_enabled:
                self._mesh = self._build_context_and_expert_mesh(device_type)
            elif self.ep_enabled:
                # dp = dp_replicate x ep: experts are sharded over "ep" and replicated over
                # "dp_replicate"; everything else is averaged over the flattened "dp".
                shape = (
                    self.pipeline_parallel,
                    self.data_parallel // self.expert_parallel,
                    self.expert_parallel,
                    self.tensor_parallel,
                )
                self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_AXIS_NAMES)
                flatten_mesh(self._mesh, _names(Axis.DP_REPLICATE, Axis.EP), str(Axis.DP))
            elif self.cp_enabled:
                # dp = dp_batch x cp: batches differ over "dp_batch"; gradients are averaged over "dp".
                shape = (
                    self.pipeline_parallel,
                    self.data_replicas,
                    self.context_parallel,
                    self.tensor_parallel,
                )
                self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=CONTEXT_AXIS_NAMES)
                flatten_mesh(self._mesh, _names(Axis.DP_BATCH, Axis.CP), str(Axis.DP))
            else:
                shape = tuple(self.degrees[name] for name in AXIS_NAMES)
                self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXIS_NAMES)
        return self._mesh

    def _build_context_and_expert_mesh(self, device_type: str) -> DeviceMesh:
        """Both axes carved out of dp: the smaller group lies inside the larger (``__post_init__`` checked).

        ``ep >= cp``: ``pp x dp_replicate x ep_mid x cp x tp`` with ``ep = ep_mid x cp``,
        ``dp_batch = dp_replicate x ep_mid``. ``cp > ep``: ``pp x dp_batch x cp_mid x ep x tp`` with
        ``cp = cp_mid x ep``, ``dp_replicate = dp_batch x cp_mid``. ``dp`` is the three middle axes.
        """

        ep, cp = self.expert_parallel, self.context_parallel
        if ep >= cp:
            names = _names(Axis.PP, Axis.DP_REPLICATE, Axis.EP_MID, Axis.CP, Axis.TP)
            shape = (self.pipeline_parallel, self.data_parallel // ep, ep // cp, cp, self.tensor_parallel)
            flattened = {
                Axis.EP: _names(Axis.EP_MID, Axis.CP),
                Axis.DP_BATCH: _names(Axis.DP_REPLICATE, Axis.EP_MID),
            }
        else:
            names = _names(Axis.PP, Axis.DP_BATCH, Axis.CP_MID, Axis.EP, Axis.TP)
            shape = (self.pipeline_parallel, self.data_parallel // cp, cp // ep, ep, self.tensor_parallel)
            flattened = {
                Axis.CP: _names(Axis.CP_MID, Axis.EP),
                Axis.DP_REPLICATE: _names(Axis.DP_BATCH, Axis.CP_MID),
            }
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for name, axes in flattened.items():
            flatten_mesh(mesh, axes, str(name))
        flatten_mesh(mesh, names[1:4], str(Axis.DP))
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh is built in `setup_environment`; it does not exist yet.")
        return self._mesh

    def describe(self) -> str:
        within = [f"ep={self.expert_parallel}"] if self.ep_enabled else []
        within += [f"cp={self.context_parallel}"] if self.cp_enabled else []
        inner = f" ({', '.join(within)} of dp)" if within else ""
        return (
            " x ".join(f"{name}={self.degrees[name]}" for name in AXIS_NAMES)
            + inner
            + f" (world {self.world_size})"
        )
