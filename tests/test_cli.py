"""``python -m lightning_parallel plan``: the plan and the bytes per rank, without processes."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_parallel.cli import main, parameter_shards
from lightning_parallel.plans import auto_plan

ROOT = Path(__file__).resolve().parents[1]
GPT = "recipes.gpt.module.GPTLightningModule"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _expected_local_elements(n_layer: int, n_embd: int, vocab: int, block: int, tp: int) -> tuple[int, int]:
    """Recipe GPT parameters (global, per rank) by hand: what tp shards and what it leaves whole."""
    C, V, T = n_embd, vocab, block
    norms = 2 * 2 * C  # ln_1, ln_2: weight + bias
    sharded = (
        3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C
    )  # qkv (w, b), attn.proj w, fc (w, b), mlp.proj w
    whole = norms + C + C  # attn.proj bias, mlp.proj bias
    block_global, block_local = sharded + whole, sharded // tp + whole
    outside_global = V * C + T * C + 2 * C  # wte (tied with lm_head), wpe, ln_f
    outside_local = V * C // tp + T * C + 2 * C
    return n_layer * block_global + outside_global, n_layer * block_local + outside_local


def test_plan_of_the_recipe_gpt(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--model", GPT, "--init", '{"n_layer": 2}', "--tensor-parallel", "2")
    assert code == 0, err
    assert out.startswith(f"model: {GPT} (128,768 parameters)")
    assert "ParallelPlan(tensor_parallel=2, sequence_parallel=False)" in out
    assert "block stack: model.transformer.h (2 blocks)" in out
    assert "model.transformer.h.1.attn.qkv   Colwise(out=S(-1), num_chunks=3)" in out
    assert "model.transformer.h.1.mlp.proj   Rowwise(in=S(-1), out=R)" in out
    assert "model.lm_head                    Colwise(out=R)" in out
    assert (
        "model.transformer.h.0.attn: attention, full-width input, fused entry q|k|v; n_head 4->2, n_embd 64->32"
        in out
    )
    assert "SequenceParallel" not in out
    # Defaults of GPTLightningModule: vocab 320, block 128, width 64; fp32.
    total, local = _expected_local_elements(n_layer=2, n_embd=64, vocab=320, block=128, tp=2)
    assert total == 128_768
    assert f"parameters per rank: {local * 4 / 1024:.1f} KiB of {total * 4 / 1024:.1f} KiB unsharded" in out
    assert "parameters per rank: 269.2 KiB of 503.0 KiB unsharded (53.5%)" in out
    assert "model.transformer.wte.weight: 10,240 of 20,480 elements, 40,960 B" in out


def test_sequence_parallel_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    init = '{"n_layer": 4, "n_head": 8, "n_embd": 128}'
    code, out, err = _run(capsys, "--model", GPT, "--init", init, "--tensor-parallel", "4", "--sequence-parallel",
                          "--dtype", "bfloat16")  # fmt: skip
    assert code == 0, err
    assert "ParallelPlan(tensor_parallel=4, sequence_parallel=True)" in out
    assert "model.transformer.h.3.ln_2" in out and "ResidualNorm(sequence_dim=1" in out
    assert "Rowwise(in=S(-1), out=S(1))" in out
    assert "n_head 8->2, n_embd 128->32" in out
    total, local = _expected_local_elements(n_layer=4, n_embd=128, vocab=320, block=128, tp=4)
    assert (
        f"parameters per rank: {local * 2 / 1024:.1f} KiB of {total * 2 / 1024**2:.1f} MiB unsharded" in out
    )


def test_parameter_shards_conv1d_and_fused(capsys: pytest.CaptureFixture[str]) -> None:
    """Hugging Face GPT-2 stores Conv1D weights transposed: column parallel splits dim 1."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=1, n_head=4,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    shards = parameter_shards(auto_plan(model, 2, sequence_parallel=False), model)
    assert shards["transformer.h.0.attn.c_attn.weight"] == (64 * 192, 64 * 96, 4)
    assert shards["transformer.h.0.attn.c_attn.bias"] == (192, 96, 4)
    assert shards["transformer.h.0.attn.c_proj.weight"] == (64 * 64, 32 * 64, 4)
    assert shards["transformer.h.0.attn.c_proj.bias"] == (64, 64, 4)  # row parallel: bias whole
    assert shards["transformer.wte.weight"] == (
        128 * 64,
        64 * 64,
        4,
    )  # vocabulary-parallel, tied with lm_head
    assert "lm_head.weight" not in shards  # a tied parameter is counted once
    assert shards["transformer.wpe.weight"] == (32 * 64, 32 * 64, 4)
    half = parameter_shards(auto_plan(model, 2, sequence_parallel=False), model, dtype=torch.bfloat16)
    assert half["transformer.h.0.ln_1.weight"] == (64, 64, 2)


def test_config_file_in_lightning_cli_format(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(f"""\
        trainer:
          devices: 4
          strategy:
            class_path: lightning_parallel.HybridParallelStrategy
            init_args:
              tensor_parallel: 4
              sequence_parallel: true
        model:
          class_path: {GPT}
          init_args:
            n_layer: 1
            n_head: 4
            n_embd: 64
    """)
    )
    code, out, err = _run(capsys, "--config", str(config))
    assert code == 0, err
    assert "ParallelPlan(tensor_parallel=4, sequence_parallel=True)" in out
    assert "block stack: model.transformer.h (1 blocks)" in out and "n_head 4->1" in out
    code, out, err = _run(capsys, "--config", str(config), "--tensor-parallel", "2")  # the flag wins
    assert code == 0, err and "ParallelPlan(tensor_parallel=2, sequence_parallel=True)" in out


def test_recipe_config_with_a_fixed_model_class_and_a_strategy_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The recipe's YAML has no class_path (its CLI fixes the class): --model names it."""
    text = (ROOT / "recipes/gpt/configs/tiny.yaml").read_text().replace("strategy: auto", "strategy: tp2_sp")
    config = tmp_path / "tiny.yaml"
    config.write_text(text)
    code, out, err = _run(capsys, "--config", str(config), "--model", GPT)
    assert code == 0, err
    assert "ParallelPlan(tensor_parallel=2, sequence_parallel=True)" in out
    assert "(124,672 parameters)" in out  # block_size 64 from the YAML: 128 x 64 fewer than the default


def test_plan_dict(capsys: pytest.CaptureFixture[str]) -> None:
    plan = '{"model.transformer.h.*.mlp.fc": "colwise", "model.transformer.h.*.mlp.proj": "rowwise"}'
    code, out, err = _run(capsys, "--model", GPT, "--plan", plan, "--tensor-parallel", "2")
    assert code == 0, err
    assert re.search(r"model\.transformer\.h\.0\.mlp\.fc +Colwise\(out=S\(-1\)\)", out)
    assert "num_chunks=3" not in out and "attention" not in out  # only what the dict names is sharded


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--model", GPT, "--tensor-parallel", "3"], "does not divide the 4 attention heads of `model.transformer.h.0.attn`"),
        (["--model", GPT, "--init", "{n_layer: 2}"], "`--init` is not valid JSON"),
        (["--model", GPT, "--init", "[1]"], "`--init` must be a JSON object"),
        (["--model", "recipes.gpt.module.NoSuchModule"], "cannot import 'NoSuchModule' from 'recipes.gpt.module'"),
        (["--model", "GPT"], "must be a dotted path"),
        ([], "Give the model class with `--model"),
        (["--model", GPT, "--plan", '{"model.nothing": "colwise"}'], "'model.nothing' matches no module"),
    ],
)  # fmt: skip
def test_errors_exit_2_with_the_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and fragment in err


def test_python_dash_m(tmp_path: Path) -> None:
    """The documented command line, in its own process."""
    command = [sys.executable, "-m", "lightning_parallel", "plan", "--model", GPT, "--init", '{"n_layer": 2}',
               "--tensor-parallel", "2", "--sequence-parallel"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ParallelPlan(tensor_parallel=2, sequence_parallel=True)" in result.stdout
    assert "parameters per rank: 269.2 KiB of 503.0 KiB unsharded" in result.stdout


def test_pipeline_stages_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "--model", "recipes.gpt.module.GPTLightningModule", "--init", '{"n_layer": 6}',
        "--tensor-parallel", "1", "--pipeline-parallel", "2", "--pipeline-schedule", "zbv",
    )  # fmt: skip
    assert code == 0
    assert "pipeline: 2 ranks, 4 stages, schedule 'zbv'" in out
    # V placement: stage 3 comes back to rank 0; 6 blocks over 4 stages, the first stages get fewer.
    assert "stage 0 (rank 0): model.transformer.h.0..model.transformer.h.0 (1 blocks" in out
    assert "stage 3 (rank 0): model.transformer.h.4..model.transformer.h.5 (2 blocks" in out
