"""Knowledge distillation as a Lightning callback: the student's ``training_step`` stays the user's own.

Why a callback: the teacher is not part of the student. Held by the callback, it is never a
submodule of the LightningModule, so it is in no checkpoint, no optimizer, no plan of the
strategy and no ``export``. The callback watches two modules of the student, found by structure
(or named): the token embedding, whose input is the token ids the teacher must read too, and
the output head, whose output is the student's logits. Around each call of the user's
``training_step`` it runs the frozen teacher (eval mode, no gradients) on those ids and returns
``(1 - alpha) * task_loss + alpha * T**2 * KL(teacher || student)`` (:mod:`.kd_loss`) in place of
the step's loss; ``self.log`` calls in the step are untouched, and the parts are logged as
``distill/task_loss`` and ``distill/kd_loss``.

Under tensor parallelism with ``loss_parallel=True`` the student's logits stay sharded over the
vocabulary and the KL is computed on the shards; the teacher, replicated on every rank, hands
each rank its slice of its logits (a local slice, no communication). Pipeline and context
parallelism are refused at the start of training: the teacher would need the same stages (or
the whole sequence), which this callback does not build yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_parallel.compression.kd_loss import distillation_kl
from lightning_parallel.compression.selection import head_and_embedding
from lightning_parallel.tensor_parallel.loss_parallel import to_plain
from lightning_parallel.tensor_parallel.styles import projection_dims

__all__ = ["KnowledgeDistillation", "find_head_and_embedding"]


def find_head_and_embedding(module: nn.Module) -> tuple[str, str]:
    """Names of the output head and the token embedding, as the tensor-parallel plan finds them."""
    found = head_and_embedding(module)
    if found is None:
        raise ValueError(
            f"{type(module).__name__} has no output head projecting onto a token embedding's vocabulary (a language"
            " model's); name them with `head=` and `embedding=`."
        )
    return found


def _logits(output: Any) -> Tensor:
    """The logits of a model's output: a tensor, or an object or dict with ``logits`` (Hugging Face)."""
    if isinstance(output, Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if not isinstance(logits, Tensor):
        raise ValueError(f"The teacher returned {type(output).__name__}, not logits (a tensor or `.logits`).")
    return logits


class KnowledgeDistillation(Callback):
    """Distil ``teacher`` into the trained LightningModule.

    Args:
        teacher: a module mapping token ids ``(B, T)`` to logits ``(B, T, V)`` (or an output with
            ``.logits``), with the student's vocabulary. Load its weights first, e.g.
            ``teacher.load_state_dict(lightning_parallel.consolidate_checkpoint(path, prefix="model."))``.
        temperature: ``T`` of the softened distributions, > 0.
        alpha: weight of the distillation term, in [0, 1] (1: the teacher alone).
        top_k: keep only the teacher's ``k`` largest logits per token (None: the whole vocabulary).
        head, embedding: the student's output head and token embedding by name (default: found by structure).
    """

    def __init__(
        self,
        teacher: nn.Module,
        *,
        temperature: float = 2.0,
        alpha: float = 0.5,
        top_k: int | None = None,
        head: str | None = None,
        embedding: str | None = None,
    ) -> None:
        if not temperature > 0:
            raise ValueError(
                f"`temperature={temperature!r}` must be > 0 (1 keeps the distributions as they are)."
            )
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"`alpha={alpha!r}` must be in [0, 1]: the weight of the distillation term.")
        if top_k is not None and top_k < 1:
            raise ValueError(
                f"`top_k={top_k!r}` must be a positive number of logits, or None for all of them."
            )
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.alpha, self.top_k = float(temperature), float(alpha), top_k
        self.head, self.embedding = head, embedding
        self.last_task_loss: Tensor | None = None  # of the last step, detached (no host sync)
        self.last_kd_loss: Tensor | None = None
        self._seen: dict[str, Tensor] = {}
        self._stepping = False
        self._hooks: list[Any] = []
        self._module: pl.LightningModule | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dims = getattr(trainer.strategy, "dims", None)
        for degree in ("pipeline_parallel", "context_parallel"):
            if dims is not None and getattr(dims, degree, 1) > 1:
                raise ValueError(
                    f"KnowledgeDistillation does not run under `{degree}={getattr(dims, degree)}` yet: the teacher"
                    " would need the student's stages or its whole sequence. Distil with tensor and data parallelism."
                )
        found_head, found_embedding = (
            (None, None) if self.head and self.embedding else find_head_and_embedding(pl_module)
        )
        head, embedding = self.head or found_head, self.embedding or found_embedding
        assert head is not None and embedding is not None
        teacher_head, _ = find_head_and_embedding(self.teacher)
        student_vocab = projection_dims(pl_module.get_submodule(head))[1]
        teacher_vocab = projection_dims(self.teacher.get_submodule(teacher_head))[1]
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"The teacher's vocabulary ({teacher_vocab} logits from `{teacher_head}`) differs from the student's"
                f" ({student_vocab} from `{head}`): distillation compares distributions over the same tokens."
            )
        self.teacher.to(pl_module.device)
        self._hooks = [
            pl_module.get_submodule(embedding).register_forward_pre_hook(self._see_ids),
            pl_module.get_submodule(head).register_forward_hook(self._see_logits),
        ]
        self._module = pl_module
        original: Callable[..., Any] = pl_module.training_step
        pl_module.training_step = self._distilling(original)  # type: ignore[method-assign]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore(pl_module)  # a failed fit leaves the module as it was given

    def _restore(self, pl_module: pl.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if "training_step" in vars(pl_module):
            del pl_module.training_step

    def _see_ids(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._stepping:  # not during validation: its logits would be kept until the next step
            # a tensor-parallel embedding's input is a replicated DTensor
            self._seen["ids"] = to_plain(args[0])

    def _see_logits(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._stepping:
            self._seen["logits"] = output

    def _kd_loss(self, student: Tensor, teacher: Tensor) -> Tensor:
        return distillation_kl(student, teacher, self.temperature, self.top_k)

    def _distilling(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._seen.clear()
            self._stepping = True
            try:
                output = step(*args, **kwargs)
            finally:
                self._stepping = False
            if "logits" not in self._seen or "ids" not in self._seen:
                raise RuntimeError(
                    "KnowledgeDistillation saw no forward of the student's embedding and head in training_step;"
                    " name them with `head=` and `embedding=`."
                )
            with torch.no_grad():
                teacher_logits = _logits(self.teacher(self._seen["ids"]))
            kd = self._kd_loss(self._seen["logits"], teacher_logits)
            task = to_plain(output["loss"] if isinstance(output, dict) else output)
            loss = (1.0 - self.alpha) * task + self.alpha * kd
            self.last_task_loss, self.last_kd_loss = task.detach(), kd.detach()
            assert self._module is not None
            self._module.log("distill/kd_loss", self.last_kd_loss)
            self._module.log("distill/task_loss", self.last_task_loss)
            self._seen.clear()
            return {**output, "loss": loss} if isinstance(output, dict) else loss

        return training_step
