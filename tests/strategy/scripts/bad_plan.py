"""A 2-rank ``fit`` whose plan cannot be applied: every rank must raise a ``ValueError`` at setup.

    python tests/strategy/scripts/bad_plan.py heads           # tp=2, a model with 3 attention heads
    python tests/strategy/scripts/bad_plan.py missing-module  # plan= names a module that does not exist
    python tests/strategy/scripts/bad_plan.py pp-more-stages-than-blocks   # pp=2, one block
    python tests/strategy/scripts/bad_plan.py pp-batch-not-divisible       # batch 4, micro_batches=3
    python tests/strategy/scripts/bad_plan.py pp-step-calls-model-twice    # training_step runs the model twice
    python tests/strategy/scripts/bad_plan.py ep-experts-not-divisible     # 3 experts, expert_parallel=2
    python tests/strategy/scripts/bad_plan.py cp-length-not-divisible      # context_parallel=2, 14 tokens
    python tests/strategy/scripts/bad_plan.py sp-length-not-divisible      # tp=2 + sp, 15 tokens (also -unverified)
    python tests/strategy/scripts/bad_plan.py tp-ranks-read-different-data # tp=2, each rank its own random data
    python tests/strategy/scripts/bad_plan.py resume-another-model         # a checkpoint of a narrower model
    python tests/strategy/scripts/bad_plan.py cp-ulysses-heads              # Ulysses on 2 ranks, 3 heads
    python tests/strategy/scripts/bad_plan.py cp-eager-attention           # HF GPT-2 with eager attention
    python tests/strategy/scripts/bad_plan.py cp-moe-capacity              # MoE dropping tokens, context_parallel=2
    python tests/strategy/scripts/bad_plan.py pp-manual-optimization       # manual_backward under pipeline stages
    python tests/strategy/scripts/bad_plan.py dp-ranks-with-unequal-batches  # the user's loaders, 2 and 3 batches
    python tests/strategy/scripts/bad_plan.py pp-last-batch-smaller        # pp=2, 10 samples in batches of 4
    python tests/strategy/scripts/bad_plan.py resume-not-a-checkpoint      # ckpt_path= a text file

Each takes a folder after the case (where the resume cases write their checkpoint). Run by
``tests/strategy/test_bad_input.py`` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule


class ManualGPT(GPTLightningModule):
    """Manual optimization: the step calls backward and the optimizer itself."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class TwiceGPT(GPTLightningModule):
    """A step the pipeline cannot cut: the model runs twice (e.g. a consistency loss)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 0.1 * super().training_step(batch, batch_idx)


def main(case: str, folder: Path) -> None:
    """``folder``: where a resume case writes the checkpoint it resumes from (the test's own temp folder)."""
    torch.set_num_threads(1)
    L.seed_everything(0)
    length = 16
    if case == "heads":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=3, n_embd=48)
        strategy = HybridParallelStrategy(tensor_parallel=2, timeout=30)
    elif case == "missing-module":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32)
        plan = {"model.transformer.h.*.attn.qkv": "fused_qkv", "model.transformer.h.*.attn.c_proj": "rowwise"}
        strategy = HybridParallelStrategy(tensor_parallel=2, plan=plan, timeout=30)
    elif case == "pp-more-stages-than-blocks":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(pipeline_parallel=2, timeout=30)
    elif case == "pp-batch-not-divisible":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(
            pipeline_parallel=2, micro_batches=3, pipeline_schedule="gpipe", timeout=30
        )
    elif case == "ep-experts-not-divisible":
        from recipes.moe.module import MoEGPTLightningModule

        model = MoEGPTLightningModule(
            vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32, num_experts=3
        )
        strategy = HybridParallelStrategy(expert_parallel=2, timeout=30)
    elif case == "pp-step-calls-model-twice":
        model = TwiceGPT(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(pipeline_parallel=2, timeout=30)
    elif case == "cp-length-not-divisible":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(context_parallel=2, timeout=30)
        length = 14
    elif case in ("sp-length-not-divisible", "sp-length-not-divisible-unverified"):
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(tensor_parallel=2, sequence_parallel=True, timeout=30,
                                          verify_plan=case.endswith("-unverified") is False)  # fmt: skip
        length = 15
    elif case == "cp-ulysses-heads":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=3, n_embd=48)
        strategy = HybridParallelStrategy(context_parallel=2, context_parallel_mode="ulysses", timeout=30)
    elif case == "cp-eager-attention":
        from tests.models.hf import HFGPT2Module

        model = HFGPT2Module(vocab_size=128, block_size=16, n_layer=1, attn_implementation="eager")
        strategy = HybridParallelStrategy(context_parallel=2, timeout=30)
    elif case == "cp-moe-capacity":  # which tokens an expert drops depends on which tokens a rank routes
        from recipes.moe.module import MoEGPTLightningModule

        model = MoEGPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32, num_experts=4,
                                      capacity_factor=1.0)  # fmt: skip
        strategy = HybridParallelStrategy(context_parallel=2, timeout=30)
    elif case == "tp-ranks-read-different-data":  # each rank draws its own (unseeded) dataset
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(tensor_parallel=2, timeout=30)
        torch.manual_seed(int(os.environ["RANK"]))
    elif case == "resume-another-model":
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=48)
        strategy = HybridParallelStrategy(tensor_parallel=2, timeout=30)
    elif case == "pp-manual-optimization":
        model = ManualGPT(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
        strategy = HybridParallelStrategy(pipeline_parallel=2, timeout=30)
    elif case in ("dp-ranks-with-unequal-batches", "pp-last-batch-smaller", "resume-not-a-checkpoint"):
        model = GPTLightningModule(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
        pipeline = {"pipeline_parallel": 2, "micro_batches": 2} if case == "pp-last-batch-smaller" else {}
        strategy = HybridParallelStrategy(timeout=30, **pipeline)
    else:
        raise SystemExit(f"unknown case {case!r}")
    samples = {"dp-ranks-with-unequal-batches": 8 + 4 * int(os.environ["RANK"]), "pp-last-batch-smaller": 10}
    tokens = torch.randint(128, (samples.get(case, 8), length + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)

    def trainer(strategy: HybridParallelStrategy) -> L.Trainer:
        own_sampler = (
            case == "dp-ranks-with-unequal-batches"
        )  # each rank its own loader, no DistributedSampler
        return L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=not own_sampler,
        )  # fmt: skip

    ckpt_path = None
    if case == "resume-not-a-checkpoint":  # a file, but not one torch.save wrote
        ckpt_path = folder / "not-a-checkpoint.txt"
        ckpt_path.write_text("not a checkpoint")
    if case == "resume-another-model":  # a checkpoint of a narrower model, then a resume into this one
        first = trainer(HybridParallelStrategy(tensor_parallel=2, timeout=30))
        first.fit(GPTLightningModule(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=32), loader)
        ckpt_path = folder / "narrower.ckpt"
        first.save_checkpoint(ckpt_path)
    trainer(strategy).fit(model, loader, ckpt_path=ckpt_path)
    print("fit finished: the bad plan was NOT refused", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
