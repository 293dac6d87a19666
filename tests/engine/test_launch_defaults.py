"""The engine launched as its users launch it (`rollout --launch defaults`): LLM(model, dtype=bfloat16, seed=S),
compile on, prefix caching, chunked prefill, its cores; SamplingParams(n=G, temperature=T, max_tokens=L,
logprobs=0), no prompt log-probs.

    the dump holds what vLLM's own API returns, launched so      (an independent script, bit for bit)
    the as-is comparison runs on the sampled tokens              (prompt tokens not recorded: left out, not "equal")
    the contract follows the compiled engine, every sampled      (Inductor, in one process and on FSDP2 x 2 with the
      log-prob bitwise                                             norms' orders read off the engine's code; Llama on
                                                                   FSDP2, Qwen3 in one process; prompts cut into
                                                                   chunks by the scheduler's token budget, samples'
                                                                   prompts prefix-cache hits)
    an engine run as a narrower CPU family (--isa avx2 on an AVX-512 CPU: its Inductor at 256 bits) is followed at
      that vector width on FSDP2 x 2 (cpp.simdlen), every sampled log-prob bitwise
    an eager training side, or FSDP2 units without the engine's norm orders (a dump written before they were read),
      are refused in one line before a model is built
    with --prompt-logprobs, each sample's own prompt log-probs (vLLM returns one sample's for all G), every one
      bitwise under the contract
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fx_precision.dump import load_dump
from fx_precision.tools.checkpoint import write_tiny_checkpoint
from tests.engine.direct_check import assert_dump_is_vllms_own

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
SAMPLES, MAX_TOKENS, TEMPERATURE, PROMPT_LENS = 4, 6, "1.0", "9,64,1500,1500,1500"
PROMPTS = len(PROMPT_LENS.split(","))


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"fx-precision {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(f"defaults-{request.param}")
    dims = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 320}
    checkpoint = write_tiny_checkpoint(request.param, root / "ckpt", seed=17, dims=dims)
    # 3 x 1,500 + 73 prompt rows: more than the scheduler's 4,096-token budget, so a prompt is cut into chunks
    run("rollout", "--model", str(checkpoint), "--prompt-lens", PROMPT_LENS, "--samples", str(SAMPLES), "--max-tokens", str(MAX_TOKENS),
        "--temperature", TEMPERATURE, "--seed", "4", "--launch", "defaults", "--out", str(root / "dump"))  # fmt: skip
    return {"checkpoint": checkpoint, "dump": root / "dump"}


def test_the_dump_holds_what_vllms_own_api_returns_as_users_launch_it(launched: dict[str, Path], tmp_path: Path) -> None:
    dump = load_dump(str(launched["dump"]))
    engine = dump.engine
    assert engine["launch"] == "defaults" and engine["compiled"] and engine["prefix_caching"] and not engine["prompt_logprobs"]
    assert engine["threads"] == (os.cpu_count() or 1)
    assert_dump_is_vllms_own(dump, launched["checkpoint"], tmp_path, MAX_TOKENS, 4, SAMPLES, TEMPERATURE)


def test_as_is_the_sampled_tokens_are_compared_and_the_prompt_is_not_claimed(launched: dict[str, Path]) -> None:
    report = json.loads(run("compare", "--model", str(launched["checkpoint"]), "--rollout", str(launched["dump"]), "--json").stdout)
    lp = report["logprob"]
    assert lp["comparable"] and not lp["prompt_recorded"] and lp["non_finite"] == 0
    assert lp["prompt"]["tokens"] == 0 and lp["prompt"]["bitwise_share"] is None  # nothing compared, nothing claimed
    assert lp["generated"]["tokens"] == PROMPTS * SAMPLES * MAX_TOKENS and lp["generated"]["mean"] > 0


RANKS = {"llama": ("--world-size", "2"), "qwen3": ()}  # FSDP2 x 2 on one architecture, in one process on the other


def test_the_contract_follows_the_compiled_engine_on_every_sampled_token(launched: dict[str, Path]) -> None:
    dump = load_dump(str(launched["dump"]))
    steps = [len(rows) for rows in dump.engine["steps"]]
    assert steps[0] < sum(s.prompt_len for s in dump.sequences) and max(steps) <= 4096  # chunks and prefix-cache hits
    contract = dump.contract
    assert contract["norm"] == "inductor" and contract["rotary"]["form"] == "inductor" and not contract["unmatched"]
    assert contract["inductor"] and contract["inductor"].startswith("torch ")
    config = json.loads((launched["checkpoint"] / "config.json").read_text())
    layers, per_layer = config["num_hidden_layers"], 4 if config["model_type"] == "qwen3" else 2  # each layer's norms (q, k on Qwen3)
    sums = contract["norm_reductions"]
    assert len(sums) == layers * per_layer + 1 and all(r["lanes"] % r["width"] == 0 and r["module"] is None for r in sums), sums
    report = json.loads(run("compare", "--model", str(launched["checkpoint"]), "--rollout", str(launched["dump"]), "--contract", "vllm",
                            "--compiled", *RANKS[config["model_type"]], "--json").stdout)  # fmt: skip
    lp = report["logprob"]
    assert lp["comparable"] and lp["generated"]["tokens"] == PROMPTS * SAMPLES * MAX_TOKENS, lp
    assert lp["generated"]["bitwise_share"] == 1.0, lp["generated"]
    assert all(s["bitwise"] for s in lp["sequences"]), lp["sequences"]


@pytest.mark.parametrize(("flags", "named", "orders"), [((), "--compiled", True), (("--compiled", "--world-size", "2"), "FSDP2", False)],
                         ids=["eager", "fsdp2-without-orders"])  # fmt: skip
def test_what_the_contract_does_not_follow_on_the_compiled_engine_is_refused_in_one_line(
    launched: dict[str, Path], flags: tuple[str, ...], named: str, orders: bool, tmp_path: Path
) -> None:
    dump = launched["dump"]
    if not orders:  # the dump as a rollout before the norms' orders were read wrote it
        import shutil

        dump = tmp_path / "dump"
        shutil.copytree(launched["dump"], dump)
        manifest = json.loads((dump / "manifest.json").read_text())
        manifest["contract"]["norm_reductions"] = None
        (dump / "manifest.json").write_text(json.dumps(manifest))
    done = run("compare", "--model", str(launched["checkpoint"]), "--rollout", str(dump), "--contract", "vllm", *flags,
               check=False)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and named in last and "--launch eager" in last, last
    assert "Traceback" not in done.stderr and "Loading weights" not in done.stderr


def test_an_engine_run_as_the_avx2_family_is_followed_at_its_vector_width(tmp_path: Path) -> None:
    """vLLM's AVX2 kernel build and, in it, Inductor at 256 bits (ATen keeps the machine's capability): the contract
    records that Inductor build and the training side compiles at its width, FSDP2 x 2, 100 % of sampled tokens."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    widths = {isa.bit_width() for isa in valid_vec_isa_list()}
    if not {256, 512} <= widths:
        pytest.skip(f"this CPU's Inductor picks widths {sorted(widths)}: an AVX2 engine is the machine's own family here or cannot run")
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=23)
    run("rollout", "--model", str(checkpoint), "--prompt-lens", "9,300", "--samples", "2", "--max-tokens", "6", "--temperature", "1.0",
        "--seed", "5", "--launch", "defaults", "--isa", "avx2", "--out", str(tmp_path / "dump"))  # fmt: skip
    contract = load_dump(str(tmp_path / "dump")).contract
    assert ", avx2, " in contract["inductor"] and contract["norm_reductions"], contract["inductor"]
    report = json.loads(run("compare", "--model", str(checkpoint), "--rollout", str(tmp_path / "dump"), "--contract", "vllm", "--compiled",
                            "--world-size", "2", "--json").stdout)  # fmt: skip
    lp = report["logprob"]
    assert lp["generated"]["tokens"] == 2 * 2 * 6 and lp["generated"]["bitwise_share"] == 1.0, lp["generated"]


def test_each_samples_prompt_logprobs_are_its_own_and_followed(tmp_path: Path) -> None:
    """G samples of one prompt with prompt log-probs: vLLM computes them per sample (each child request in its own
    place among the step's requests, the third's prompt cut across two steps) but returns one sample's for all; the
    rollout records each sample's own, and the contract gives every prompt and sampled log-prob bit for bit."""
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=29)
    run("rollout", "--model", str(checkpoint), "--prompt-lens", "2000", "--samples", "4", "--max-tokens", "4", "--temperature", "1.0",
        "--seed", "3", "--launch", "defaults", "--prompt-logprobs", "--out", str(tmp_path / "dump"))  # fmt: skip
    dump = load_dump(str(tmp_path / "dump"))
    assert dump.engine["prompt_logprobs"] and len(dump.engine["steps"][0]) == 4096  # two prompts and a piece of the third
    report = json.loads(run("compare", "--model", str(checkpoint), "--rollout", str(tmp_path / "dump"), "--contract", "vllm", "--compiled",
                            "--json").stdout)  # fmt: skip
    lp = report["logprob"]
    assert lp["prompt"]["tokens"] == 4 * 1999 and lp["prompt"]["bitwise_share"] == 1.0, lp["prompt"]
    assert lp["generated"]["tokens"] == 4 * 4 and lp["generated"]["bitwise_share"] == 1.0, lp["generated"]
