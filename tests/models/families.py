"""The model families every parity test draws from, and the synthetic data they train on.

``FAMILIES[name](**overrides)`` builds a fresh, seeded LightningModule: the same initial
weights in every process that calls it. All families share one vocabulary and sequence
length (``VOCAB_SIZE``, ``SEQ_LEN``) so one dataset serves them all. Imports are lazy: a
family's dependencies (``transformers``, the recipe) load only when it is built, so a broken
or missing optional family does not break the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.models.optim import OPTIMIZERS, parity_optimizer

if TYPE_CHECKING:  # lightning is imported by the families themselves, when built
    import lightning as L

__all__ = [
    "FAMILIES",
    "SEQ_LEN",
    "VOCAB_SIZE",
    "TokenWindows",
    "build",
    "global_batch",
    "make_dataloader",
    "reference_dataloader",
]

VOCAB_SIZE = 128
SEQ_LEN = 32
MODEL_SEED = 1234


def _nanogpt(**overrides: Any) -> L.LightningModule:
    from tests.models.nanogpt import NanoGPTModule

    return NanoGPTModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_gpt2(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFGPT2Module

    return HFGPT2Module(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_llama(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFLlamaModule

    return HFLlamaModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_opt(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFOPTModule

    return HFOPTModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_qwen3(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFQwen3Module

    return HFQwen3Module(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_mixtral(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFMixtralModule

    return HFMixtralModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_gpt_oss(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFGptOssModule

    return HFGptOssModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _hf_mixtral_aux(**overrides: Any) -> L.LightningModule:
    from tests.models.hf import HFMixtralAuxModule

    return HFMixtralAuxModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _recipe_moe(sgd_learning_rate: float | None = None, **overrides: Any) -> L.LightningModule:
    """The project's MoE recipe at test size: 4 experts, top-2, capacity factor 1.25 (tokens dropped),
    its own training step (task loss + the layers' aux losses), SGD like the other families
    (``sgd_learning_rate``: its rate, 0.1 by default; the recipe's own ``learning_rate`` is AdamW's)."""
    from recipes.moe.module import MoEGPTLightningModule

    tiny = dict(
        vocab_size=VOCAB_SIZE, block_size=SEQ_LEN, n_layer=2, n_head=4, n_embd=64, num_experts=4, top_k=2,
        capacity_factor=1.25, dropout=0.0, learning_rate=1e-3, warmup_steps=1, lr_decay_steps=1000,
    )  # fmt: skip

    class RecipeMoEWithSGD(MoEGPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return parity_optimizer(self.parameters(), "sgd", sgd_learning_rate)

    return RecipeMoEWithSGD(**{**tiny, **overrides})


def _recipe_gpt(
    optimizer: str = "sgd", sgd_learning_rate: float | None = None, **overrides: Any
) -> L.LightningModule:
    """The project's GPT recipe at test size.

    Its model, ``training_step`` and loss are the recipe's own. The optimizer is SGD with
    momentum by default, as for the hand-written families (docs/testing.md, "Adam and the
    parameter tolerance"): the recipe's AdamW turns rounding in near-zero gradients into
    parameter differences above the fp32 parity tolerance even under plain DDP.
    ``optimizer="adamw"`` keeps the recipe's own AdamW (with ``eps=1e-5``); ``sgd_learning_rate``: SGD's rate
    (0.1 by default; the recipe's own ``learning_rate`` is AdamW's).
    """
    from recipes.gpt.module import GPTLightningModule

    tiny = dict(
        vocab_size=VOCAB_SIZE, block_size=SEQ_LEN, n_layer=2, n_head=4, n_embd=64, dropout=0.0,
        learning_rate=1e-3, warmup_steps=1, lr_decay_steps=1000, eps=1e-5,
    )  # fmt: skip
    if optimizer == "adamw":
        return GPTLightningModule(**{**tiny, **overrides})
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"recipe_gpt: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")

    class RecipeGPTWithSGD(GPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return parity_optimizer(self.parameters(), "sgd", sgd_learning_rate)

    return RecipeGPTWithSGD(**{**tiny, **overrides})


def _zoo(name: str) -> Callable[..., L.LightningModule]:
    def build_family(**overrides: Any) -> L.LightningModule:
        from tests.models.hf import HFZooModule

        return HFZooModule(name, **{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})

    return build_family


def _zoo_families() -> dict[str, Callable[..., L.LightningModule]]:
    """``zoo_<model_type>`` for every family of ``tests/models/zoo.py`` (its table imports nothing heavy)."""
    from tests.models.zoo import ZOO

    return {f"zoo_{name}": _zoo(name) for name in ZOO}


def _hf_tiny(model_type: str, **overrides: Any) -> L.LightningModule:
    """Any decoder family of the installed ``transformers`` from its tiny config (``tools/hf_sweep.py``)."""
    from tests.models.hf import HFTinyModule

    return HFTinyModule(model_type, **{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _per_layer_inputs(**overrides: Any) -> L.LightningModule:
    from tests.models.per_layer_inputs import PerLayerInputsModule

    return PerLayerInputsModule(**{"vocab_size": VOCAB_SIZE, "block_size": SEQ_LEN, **overrides})


def _recipe_gpt_dict(**overrides: Any) -> L.LightningModule:
    """The GPT recipe whose step returns a dict (``{"loss": ..., "tokens": ...}``), as Lightning allows."""
    model = _recipe_gpt(**overrides)

    class DictOutput(type(model)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            return {"loss": super().training_step(batch, batch_idx), "tokens": batch[0].numel()}

    model.__class__ = DictOutput
    return model


FAMILIES: dict[str, Callable[..., L.LightningModule]] = {
    "recipe_gpt": _recipe_gpt,
    "recipe_gpt_dict": _recipe_gpt_dict,
    "nanogpt": _nanogpt,
    "hf_gpt2": _hf_gpt2,
    "hf_llama": _hf_llama,
    "hf_opt": _hf_opt,
    "hf_qwen3": _hf_qwen3,
    "hf_mixtral": _hf_mixtral,
    "hf_gpt_oss": _hf_gpt_oss,
    "recipe_moe": _recipe_moe,
    "hf_mixtral_aux": _hf_mixtral_aux,
    "hf_tiny": _hf_tiny,
    "per_layer_inputs": _per_layer_inputs,
    **_zoo_families(),
}


def build(family: str, seed: int = MODEL_SEED, **overrides: Any) -> L.LightningModule:
    """A fresh module of ``family`` with weights drawn from ``torch.manual_seed(seed)``."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown model family {family!r}; known: {sorted(FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FAMILIES[family](**overrides)


DATA = ("random", "learnable")


class TokenWindows(Dataset):
    """``num_samples`` windows ``(x, y)`` of ``seq_len`` tokens cut from one seeded stream.

    ``y`` is ``x`` shifted by one token. Sample ``i`` is the same in every process.

    ``data="random"``: uniform tokens, nothing to learn: the loss stays near ``ln(vocab_size)``
    and a few steps move it by hundredths, which is enough for fp32 parity (every parameter is
    compared at 1e-5) but hides a wrong gradient behind a low-precision tolerance.
    ``data="learnable"``: tokens of a seeded ``ALPHABET`` of 16, each followed by a fixed
    successor (a seeded permutation of the alphabet), except that one token in ``RESTART`` jumps
    to a random letter; the model learns the alphabet, then the table, within a few steps, so the
    loss falls by far more than the low-precision tolerance (docs/testing.md, "Low precision").
    """

    ALPHABET = 16
    RESTART = 16

    def __init__(
        self,
        num_samples: int,
        seq_len: int = SEQ_LEN,
        vocab_size: int = VOCAB_SIZE,
        seed: int = 0,
        data: str = "random",
    ) -> None:
        if data not in DATA:
            raise ValueError(f"data must be one of {DATA}, got {data!r}")
        generator = torch.Generator().manual_seed(seed)
        stream_len = 4 * num_samples * seq_len + 1
        self.stream = torch.randint(vocab_size, (stream_len,), generator=generator)
        if data == "learnable":
            alphabet = torch.randperm(vocab_size, generator=generator)[: self.ALPHABET]
            successor = torch.full((vocab_size,), -1, dtype=torch.long)
            successor[alphabet] = alphabet[torch.randperm(self.ALPHABET, generator=generator)]
            jump = torch.randint(self.RESTART, (stream_len,), generator=generator) == 0
            self.stream = alphabet[torch.randint(self.ALPHABET, (stream_len,), generator=generator)]
            for i in range(1, stream_len):
                if not jump[i]:
                    self.stream[i] = successor[self.stream[i - 1]]
        self.starts = torch.randint(stream_len - seq_len, (num_samples,), generator=generator)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        window = self.stream[s : s + self.seq_len + 1]
        return window[:-1], window[1:]


def global_batch(per_rank_batch_size: int, data_parallel: int) -> int:
    """Samples per step over all data-parallel replicas: what one process must see to match them."""
    return per_rank_batch_size * data_parallel


def make_dataloader(batch_size: int, num_samples: int, seed: int = 0, data: str = "random") -> DataLoader:
    """Batches of ``batch_size`` :class:`TokenWindows` in order, for a distributed run.

    Under ``use_distributed_sampler=True`` Lightning replaces the sampler with a
    ``DistributedSampler`` that SHUFFLES (Lightning forces ``shuffle=True`` for every training
    dataloader, whatever the loader says) with ``seed=PL_GLOBAL_SEED`` and epoch 0: rank ``r`` of
    ``R`` gets ``perm[r], perm[r+R], ...``, so batch ``i`` of all ranks together holds exactly
    the samples ``perm[i*b*R : (i+1)*b*R]``. :func:`reference_dataloader` loads those batches.
    """
    return DataLoader(
        TokenWindows(num_samples, seed=seed, data=data), batch_size=batch_size, shuffle=False, num_workers=0
    )


def reference_dataloader(
    batch_size: int,
    data_parallel: int,
    num_samples: int,
    sampler_seed: int,
    seed: int = 0,
    data: str = "random",
    reverse_within_batch: bool = False,
) -> DataLoader:
    """One process's loader whose batch ``i`` holds the samples of batch ``i`` of all replicas.

    ``batch_size`` is per rank; batches hold ``global_batch(batch_size, data_parallel)`` samples
    in the order of ``DistributedSampler(num_replicas=1, shuffle=True, seed=sampler_seed)``:
    the same permutation the replicas' samplers split (``sampler_seed`` is the run's
    ``seed_everything`` seed; ``set_epoch`` is called on it by Lightning as on theirs).

    ``reverse_within_batch``: each batch holds the same samples in the reverse order, which
    changes nothing but the order of the reductions over the batch: the spread this gives a
    low-precision run is what its tolerance is derived from (tests/distributed/tolerance.py).
    """
    dataset = TokenWindows(num_samples, seed=seed, data=data)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=sampler_seed)
    collate = _reversed_collate if reverse_within_batch else None
    return DataLoader(
        dataset,
        batch_size=global_batch(batch_size, data_parallel),
        sampler=sampler,
        num_workers=0,
        collate_fn=collate,
    )


def _reversed_collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.utils.data import default_collate

    return default_collate(samples[::-1])
