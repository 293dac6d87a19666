"""The contract at a published model's widths, against the live engine (the engine environment).

Qwen3-0.6B's every dimension (hidden 1024, 16 / 8 heads of 128, intermediate 3072, vocabulary 151936, tied
embeddings; tests/configs/qwen3-0.6b) with 2 decoder layers and random weights, one rollout of three prompts
(11, 97 and 1100 tokens: one step prefills them all, 1208 rows, then decode steps of 3 rows) with 8 sampled
tokens each, module records on; the engine on 1 thread. At these widths the engine's GEMM sums rows of a
1208-row call in other K blocks than rows of a 3-row one, so every linear must follow the call it came from, and
the long prompt's rows see their keys in several of the engine's KV tiles (320 keys each on a 1 MiB L2, 736 on
Sapphire Rapids), which the attention must follow too:

    bitwise, compiled on the machine's threads and eager on 1        (the trainer's threads never matter)
    a planted mismatch (the norm rewrite off) is named                (first origin: the norm; its first op)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fx_precision.dump import load_dump
from fx_precision.tools.checkpoint import write_shaped_checkpoint

CONFIG = Path(__file__).parents[1] / "configs" / "qwen3-0.6b" / "config.json"
CLI = [sys.executable, "-m", "fx_precision.tools.cli"]


def run(*args: str, threads: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise AssertionError(f"fx-precision {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published")
    checkpoint = write_shaped_checkpoint(CONFIG, root / "qwen3-0.6b", layers=2, seed=5)
    run("rollout", "--launch", "eager",
            "--model", str(checkpoint), "--prompt-lens", "11,97,1100", "--max-tokens", "8", "--modules", "--threads", "1",
        "--split-kv", "off", "--out", str(root / "dump"))  # fmt: skip
    return {"checkpoint": checkpoint, "dump": root / "dump"}


def _compare(shaped: dict[str, Path], *extra: str, threads: int | None = None) -> dict[str, Any]:
    args = ("compare", "--model", str(shaped["checkpoint"]), "--rollout", str(shaped["dump"]), "--contract", "vllm", "--json", *extra)
    return json.loads(run(*args, threads=threads).stdout)


def test_the_rollout_read_every_linear_call_it_made(shaped: dict[str, Path]) -> None:
    contract = load_dump(str(shaped["dump"])).contract
    assert contract["evidence"]["matched"] == {"rotary": True, "norm": True, "attention": True, "linears": True}
    rows = {call["rows"] for call in contract["linears"]["calls"]}
    assert {1208, 3} <= rows, rows  # the prefill step of every prompt, the decode steps
    tiling = contract["kv_tiling"]  # where the engine's attention placed its KV tiles: what the training side follows
    assert tiling["head_dim"] == 128 and tiling["threads"] == 1 and tiling["l2_cache_bytes"] > 0, tiling
    orders = {json.dumps(call["order"]) for call in contract["linears"]["calls"]}
    kernels = {call["order"]["kernel"] for call in contract["linears"]["calls"]}
    if kernels == {"lanes"}:  # torch's F.linear (oneDNN refuses bf16 on AVX2): one order for every row count, by design
        assert len(orders) == 1, orders
    else:  # at these widths oneDNN's GEMM sums calls of other sizes in other orders
        assert len(orders) > 1, orders


@pytest.mark.parametrize(("extra", "threads"), [(("--compiled",), None), ((), 1)], ids=["inductor", "eager-1-thread"])
def test_every_logprob_is_bitwise_at_published_widths(shaped: dict[str, Path], extra: tuple[str, ...], threads: int | None) -> None:
    report = _compare(shaped, *extra, threads=threads)
    lp = report["logprob"]
    assert lp["comparable"], lp.get("why")
    assert lp["prompt"]["bitwise_share"] == 1.0 and lp["generated"]["bitwise_share"] == 1.0, lp
    assert report["contract_notes"] == [] and report["first_origin"] is None, report["contract_notes"]


def test_a_planted_mismatch_is_named_by_its_origin_and_op(shaped: dict[str, Path]) -> None:
    """The contract's fused add + norm left out (the training side normalises the rounded sum): the comparator, on
    the training side's module records under the contract, names the first norm after a residual add, and run alone
    on the engine's inputs under the contract, the op that made its differing output."""
    from fx_precision.compare import compare
    from fx_precision.contract import contract_of_dump
    from fx_precision.policy_flags import PolicyFlags
    from fx_precision.tools.train_side import train_against
    from fx_precision.training_side import RunConfig

    engine = load_dump(str(shaped["dump"]))
    assert not isinstance(engine, dict)
    evidence = engine.contract["evidence"]  # planted with its evidence: a dump whose contract contradicts it is refused
    kept = {**evidence, "norm": {**evidence["norm"], "kept": "plain"}}
    planted = replace(engine, contract={**engine.contract, "norm": "plain", "evidence": kept})
    train = train_against(planted, RunConfig(str(shaped["checkpoint"]), policy=PolicyFlags(), contract=contract_of_dump(planted)))
    result = compare(train, planted)
    assert result.logprob is not None and result.logprob["prompt"]["bitwise_share"] < 0.5
    assert result.first_origin is not None and result.first_origin.fqn == "model.layers.0.post_attention_layernorm"
    assert result.first_op is not None and result.first_op.module == "model.layers.0.post_attention_layernorm" and result.first_op.op_a
