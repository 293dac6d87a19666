"""Granite against the real engine: its multipliers (embedding, residual, attention) and its logits scaling.

eager engine      the logits processor's GEMM probed alone and its scale (1 / logits_scaling, one bf16 rounding of
                  x * scale) recorded: compare --contract vllm, eager and compiled training side, bitwise on every log-prob
compiled engine   Granite adds its residual itself (residual + h * residual_multiplier, bf16), which vLLM's Inductor
                  keeps in fp32 and rounds where a norm's kernel stores it: read off its generated code by the rollout
                  (contract.norm_reductions: stores, summed), followed in process and on FSDP2 x 2; without those
                  reductions, refused in one line
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fx_precision.tools.checkpoint import write_shaped_checkpoint

CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
GRANITE = {  # held out: sizes and multipliers no other test names
    "architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 2600, "hidden_size": 160, "intermediate_size": 416,
    "num_hidden_layers": 2, "num_attention_heads": 5, "num_key_value_heads": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "embedding_multiplier": 9.0, "residual_multiplier": 0.31,
    "attention_multiplier": 0.0390625, "logits_scaling": 7.0, "hidden_act": "silu", "initializer_range": 0.05, "torch_dtype": "bfloat16",
}  # fmt: skip


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, check=False)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("granite")
    (root / "config.json").write_text(json.dumps(GRANITE))
    return write_shaped_checkpoint(root / "config.json", root / "ckpt", layers=2, seed=7)


@pytest.fixture(scope="module")
def eager_dump(granite: Path) -> Path:
    dump = granite.parent / "eager"
    done = run("rollout", "--model", str(granite), "--launch", "eager", "--prompt-lens", "5,61", "--samples", "2", "--max-tokens", "6",
               "--out", str(dump), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["contract"]["logits"]["scale"] == 1.0 / 7.0
    return dump


@pytest.mark.parametrize("compiled", [False, True])
def test_granite_is_bitwise_against_the_eager_engine(granite: Path, eager_dump: Path, compiled: bool) -> None:
    done = run("compare", "--model", str(granite), "--rollout", str(eager_dump), "--contract", "vllm",
               *(["--compiled"] if compiled else []), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert "'engine-logits': 1" in report["a"], report["a"]
    assert report["logprob"]["generated"]["tokens"] == 24 and report["logprob"]["bitwise_share"] == 1.0, report["logprob"]


@pytest.fixture(scope="module")
def defaults_dump(granite: Path) -> Path:
    dump = granite.parent / "defaults"
    done = run("rollout", "--model", str(granite), "--prompt-lens", "5,61", "--samples", "2", "--max-tokens", "6", "--out", str(dump),
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    contract = json.loads(done.stdout)["contract"]
    assert contract["norm"] == "inductor-stream" and any(r["stores"] == "bfloat16" for r in contract["norm_reductions"]), contract
    return dump


@pytest.mark.parametrize("world_size", [1, 2], ids=["in-process", "fsdp2x2"])
def test_granite_is_bitwise_against_the_compiled_engine(granite: Path, defaults_dump: Path, world_size: int) -> None:
    done = run("compare", "--model", str(granite), "--rollout", str(defaults_dump), "--contract", "vllm", "--compiled",
               "--world-size", str(world_size), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["logprob"]["generated"]["tokens"] == 24 and report["logprob"]["bitwise_share"] == 1.0, report["logprob"]


def test_granite_against_the_compiled_engine_without_its_norm_reductions_is_refused_in_one_line(
    granite: Path, defaults_dump: Path, tmp_path: Path
) -> None:
    """Where the stream is rounded is only in the engine's generated code: a contract without it is never guessed at."""
    dump = tmp_path / "dump"
    shutil.copytree(defaults_dump, dump)
    manifest = json.loads((dump / "manifest.json").read_text())
    manifest["contract"]["norm_reductions"] = None
    (dump / "manifest.json").write_text(json.dumps(manifest))
    done = run("compare", "--model", str(granite), "--rollout", str(dump), "--contract", "vllm", "--compiled")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "adds its residual stream itself" in last and "--launch eager" in last, last
