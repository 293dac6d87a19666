"""The on-policy loop against a live vLLM: FSDP2 on 2 gloo ranks, compiled, G = 4, weights synced every step.

    under the contract, the rollout's log-probs, the recompute's and the first training forward's are one bit pattern
    for every sampled token of every step (ratio exactly 1), at T = 1.0 (Qwen3-style) and T = 0.7 with top-k 64 and
    top-p 0.95 (Llama-style)
    the weights change every step, and a separate `fx-precision rollout` of DIR's final checkpoint gives the last
    rollout's log-probs bit for bit: the engine ran the trainer's weights
    as users run it today (--contract none) every step mismatches, reported the same way; the reward rises either way
    with the engine at its defaults (--engine-launch defaults: compiled, prefix caching, chunked prefill), T = 0.7: under
    the contract no step mismatches (the trainer FSDP2 x 2, compiled), as users run it every step does; the contract
    there with --no-compiled is refused in one line
    strict mode stops at the first mismatch naming it; bad input and an engine that dies are one line, DIR stays whole

The checkpoints are of sizes no other test uses (widths, heads, KV heads, layers), each run is `fx-precision onpolicy`
in its own process, as a user runs it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fx_precision.dump import check_engine_dump, load_dump
from fx_precision.tools.checkpoint import write_tiny_checkpoint

CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
STEPS, SAMPLES, MAX_TOKENS, DEFAULTS_STEPS = 10, 4, 8, 4
SHAPES = {
    "qwen3": {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 320,
              "num_hidden_layers": 2},
    "llama": {"hidden_size": 160, "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 32, "intermediate_size": 288,
              "num_hidden_layers": 2},
}  # fmt: skip


def onpolicy(checkpoint: Path, out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``fx-precision onpolicy`` in its own process: the diagnostic engine (--engine-launch eager) and the aot_eager trainer
    (--no-compiled) unless ``extra`` asks for the defaults' or Inductor."""
    launch = () if "--engine-launch" in extra else ("--engine-launch", "eager")
    trainer = () if {"--compiled", "--no-compiled"} & set(extra) else ("--no-compiled",)
    args = ["onpolicy", "--model", str(checkpoint), "--out", str(out), "--samples", str(SAMPLES), "--max-tokens", str(MAX_TOKENS),
            "--json", str(out) + ".json", *launch, *trainer, *extra]  # fmt: skip
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"fx-precision {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def report(out: Path) -> dict[str, Any]:
    return json.loads(Path(str(out) + ".json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("onpolicy")
    made: dict[str, Any] = {}
    for arch, temperature, top in (("qwen3", "1.0", ()), ("llama", "0.7", ("--top-k", "64", "--top-p", "0.95"))):
        checkpoint = write_tiny_checkpoint(arch, root / f"ckpt-{arch}", seed=5, dims=SHAPES[arch])
        out = root / f"run-{arch}"
        onpolicy(checkpoint, out, "--steps", str(STEPS), "--temperature", temperature, *top, "--world-size", "2", "--compiled")
        made[arch] = {"checkpoint": checkpoint, "out": out, "report": report(out), "temperature": temperature, "top": top}
    out = root / "run-none"
    onpolicy(made["qwen3"]["checkpoint"], out, "--steps", str(STEPS), "--world-size", "2", "--compiled", "--contract", "none",
             "--mode", "audit")  # fmt: skip
    made["none"] = {"out": out, "report": report(out)}
    for contract in ("vllm", "none"):
        out = root / f"run-defaults-{contract}"
        onpolicy(made["qwen3"]["checkpoint"], out, "--steps", str(DEFAULTS_STEPS), "--temperature", "0.7", "--world-size", "2",
                 "--compiled", "--engine-launch", "defaults", "--contract", contract, "--mode", "audit")  # fmt: skip
        made[f"defaults-{contract}"] = {"out": out, "report": report(out)}
    return made


def _rising(steps: list[dict[str, Any]]) -> bool:
    rewards = [s["reward"] for s in steps]
    return sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_every_sampled_log_prob_of_every_step_is_one_bit_pattern_on_both_sides(runs: dict[str, Any], arch: str) -> None:
    data = runs[arch]["report"]
    steps = data["steps"]
    assert len(steps) == STEPS and data["stopped"] is None
    prompts = len(data["config"]["prompt_lens"])
    for s in steps:
        assert s["tokens"] == prompts * SAMPLES * MAX_TOKENS, s  # every sampled token certified
        assert s["mismatches"] == s["recompute_mismatches"] == s["forward_mismatches"] == 0, s
        assert s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0 and s["k3_kl"] == 0.0 and s["max_delta"] == 0.0, s
        assert s["prompt_mismatches"] == 0 and s["prompt_tokens"] > 0, s
    assert data["config"]["world_size"] == 2 and data["config"]["compiled"] and data["config"]["samples"] == SAMPLES
    assert float(data["config"]["temperature"]) == float(runs[arch]["temperature"])
    if runs[arch]["top"]:  # Llama samples with top-k and top-p: the processed log-probs renormalised over what they keep
        assert (data["config"]["top_k"], data["config"]["top_p"]) == (64, 0.95)
    assert _rising(steps), [s["reward"] for s in steps]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_weights_change_every_step_and_the_engine_ran_the_trainers(runs: dict[str, Any], arch: str, tmp_path: Path) -> None:
    """The engine's log-probs of one fixed sequence differ from step to step, every sync's digest is new; an independent
    rollout of DIR's final checkpoint (the same prompts, samples and temperature) gives the last rollout's prompt
    log-probs bit for bit (its samples are its own generator's: the loop's engine drew others before), and that
    checkpoint digests to what the engine reported loading."""
    from fx_precision.checkpoints import weights_digest

    out, steps = runs[arch]["out"], runs[arch]["report"]["steps"]
    fixed = [s["fixed_logprobs"] for s in steps]
    assert all(a != b for a, b in itertools.pairwise(fixed)), fixed
    assert len({s["weights"] for s in steps}) == STEPS
    last = out / "last"
    assert last.resolve().name == f"{STEPS - 1:04d}" and weights_digest(last / "checkpoint") == steps[-1]["weights"]
    engine = load_dump(str(last / "rollout"))
    assert not isinstance(engine, dict)
    check_engine_dump(engine)
    prompts = list(dict.fromkeys(tuple(s.tokens[: s.prompt_len]) for s in engine.sequences))
    (tmp_path / "prompts.json").write_text(json.dumps([list(p) for p in prompts]))
    again = tmp_path / "again"
    done = subprocess.run([*CLI, "rollout", "--launch", "eager",
            "--model", str(last / "checkpoint"), "--prompts", str(tmp_path / "prompts.json"),
                           "--samples", str(SAMPLES), "--max-tokens", str(MAX_TOKENS), "--temperature", runs[arch]["temperature"],
                           *runs[arch]["top"], "--logprobs", "processed", "--split-kv", "off", "--out", str(again)],
                          capture_output=True, text=True, env=ENV, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    independent = load_dump(str(again))
    assert not isinstance(independent, dict)
    assert [s.tokens[: s.prompt_len] for s in independent.sequences] == [s.tokens[: s.prompt_len] for s in engine.sequences]
    records = zip(engine.logprob_records(), independent.logprob_records(), strict=True)
    for s, (a, b) in zip(engine.sequences, records, strict=True):  # every prompt token's log-prob, as bits
        n = s.prompt_len - 1
        assert a.path == b.path and torch.equal(a.tensor[:n].view(torch.int32), b.tensor[:n].view(torch.int32)), (s.prompt_len, a, b)


def test_with_the_engine_at_its_defaults_the_contract_holds_every_step_and_as_is_parts(runs: dict[str, Any], tmp_path: Path) -> None:
    """The engine as users launch it (compiled, prefix caching, chunked prefill), the trainer FSDP2 x 2 compiled: under the
    contract no sampled token differs at any step; as users run it, every step has some that do."""
    prompts = len(runs["defaults-vllm"]["report"]["config"]["prompt_lens"])
    for contract, differ in (("vllm", False), ("none", True)):
        data = runs[f"defaults-{contract}"]["report"]
        steps = data["steps"]
        assert len(steps) == DEFAULTS_STEPS and data["stopped"] is None and data["config"]["engine_launch"] == "defaults"
        for s in steps:
            assert s["tokens"] == prompts * SAMPLES * MAX_TOKENS and (s["mismatches"] > 0) == differ, (contract, s)
            assert s["prompt_tokens"] == 0, s  # users sample without prompt log-probs: none asked, none claimed
            assert math.isfinite(s["loss"]), s  # the prompt's unasked log-probs never reach the loss
    done = onpolicy(runs["qwen3"]["checkpoint"], tmp_path / "refused", "--steps", "1", "--engine-launch", "defaults", check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "--engine-launch defaults" in last and "--no-compiled" in last, last
    assert not (tmp_path / "refused").exists()


def test_as_users_run_it_every_step_mismatches_and_is_reported_the_same_way(runs: dict[str, Any]) -> None:
    data = runs["none"]["report"]
    assert data["contract"] is None and data["stopped"] is None and len(data["steps"]) == STEPS
    for s in data["steps"]:
        assert s["mismatches"] > 0 and s["max_delta"] > 0 and s["ratio_min"] < 1.0 < s["ratio_max"], s
        assert s["first_mismatch"] is not None and s["k3_kl"] > 0
    assert _rising(data["steps"]), [s["reward"] for s in data["steps"]]


def test_strict_mode_stops_at_the_first_mismatch_naming_step_sequence_and_token(runs: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "strict"
    done = onpolicy(runs["qwen3"]["checkpoint"], out, "--steps", "3", "--world-size", "1", "--contract", "none", "--modules",
                    check=False)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    data = report(out)
    assert len(data["steps"]) == 1 and data["stopped"].startswith("step 0: ")
    first = data["steps"][0]["first_mismatch"]
    assert f"sequence {first['sequence']}, token {first['token']}" in data["stopped"]
    # the step's dump holds the engine's modules: the comparator names where as-is parts (bf16 autocast, fp32 gather)
    assert data["origin"]["module"].startswith("model.") and data["origin"]["op"], data["origin"]
    assert f"first origin: {data['origin']['module']}" in data["stopped"]
    assert (out / "last" / "rollout").is_dir() and (out / "last" / "checkpoint" / "model.safetensors").is_file()


def test_bad_input_is_one_line_before_a_rank_or_the_engine_starts(runs: dict[str, Any], tmp_path: Path) -> None:
    from fx_precision.engines import engine_adapter

    checkpoint = runs["qwen3"]["checkpoint"]
    (tmp_path / "outside.json").write_text(json.dumps([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 4096, 11]]))
    (tmp_path / "short.json").write_text(json.dumps([[1, 2, 3]]))
    shortest = engine_adapter("vllm").min_prompt_tokens()  # this machine's family: 5 as an AMX CPU, 1 as the others
    cases = [
        (("--samples", "0"), "--samples 0 is outside 1..64"),
        (("--temperature", "0"), "--temperature 0 is greedy"),  # vLLM refuses n > 1 at temperature 0: refused first
        (("--prompts", str(tmp_path / "outside.json")), "prompt 1: token id 4096 is outside the vocabulary"),
        (("--prompt-lens", "2040,9"), "the run needs 2049 positions"),  # what the loop adds counted: 2040 + 8 sampled + 1
        *(
            [
                (("--prompts", str(tmp_path / "short.json")), f"needs prompts of at least {shortest} tokens"),
                (("--prompt-lens", "3,9"), f"--prompt-lens 3: this engine build needs prompts of at least {shortest} tokens"),
            ]
            if shortest > 3
            else []
        ),
        (("--plot", str(tmp_path / "plot.svg")), "--plot"),
        (("--engine-python", str(tmp_path / "no-python")), "no such file"),
    ]
    for extra, needle in cases:
        out = tmp_path / "d"
        done = onpolicy(checkpoint, out, "--steps", "1", *extra, check=False)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        assert done.returncode == 2 and needle in last and "Traceback" not in done.stderr, (extra, done.stderr[-2000:])
        assert not out.exists(), extra
    done = onpolicy(checkpoint, checkpoint / "run", "--steps", "1", check=False)  # DIR inside its own source
    assert done.returncode == 2 and "sits inside" in done.stderr and not (checkpoint / "run").exists()


def test_a_checkpoint_the_engine_cannot_run_is_one_line(runs: dict[str, Any], tmp_path: Path) -> None:
    """An architecture vLLM registers no class for is refused before anything starts; one it loads but cannot run
    (head_dim 8: its CPU attention has no kernel for it) stops every rank with the engine's one line, and DIR holds
    no step (its engine.log says what the engine printed)."""
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for f in runs["qwen3"]["checkpoint"].iterdir():
        (unknown / f.name).write_bytes(f.read_bytes())
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NotAModelForCausalLM"]}))
    done = onpolicy(unknown, tmp_path / "d1", "--steps", "1", check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "vLLM has no model class for NotAModelForCausalLM" in last and "Traceback" not in done.stderr
    assert not (tmp_path / "d1").exists()
    hd8 = write_tiny_checkpoint("qwen3", tmp_path / "hd8", dims={"hidden_size": 64, "head_dim": 8, "num_attention_heads": 8})
    done = onpolicy(hd8, tmp_path / "d2", "--steps", "2", "--world-size", "2", check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "vLLM cannot" in last and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "d2" / "last").exists() and (tmp_path / "d2" / "engine.log").is_file()


def _engine_pids(parent: int) -> list[int]:
    """The engine server processes below ``parent`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "fx_precision.engines.serve" not in cmdline:
                continue
            pid = int(entry.name)
            while pid > 1:
                stat = (Path("/proc") / str(pid) / "stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])
                if pid == parent:
                    found.append(int(entry.name))
                    break
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_an_engine_that_dies_mid_run_is_one_line_and_dir_keeps_the_last_complete_step(runs: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "dies"
    args = ["onpolicy", "--model", str(runs["qwen3"]["checkpoint"]), "--out", str(out), "--steps", "40", "--world-size", "1",
            "--samples", "2", "--max-tokens", "4", "--engine-launch", "eager", "--no-compiled"]  # fmt: skip
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.json"
        if metrics.exists() and len(json.loads(metrics.read_text())["steps"]) >= 2:
            break
        time.sleep(0.2)
    pids = _engine_pids(proc.pid)
    assert pids and proc.poll() is None, "the run ended before its engine could be stopped"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    last = stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "the engine process died" in last and "Traceback" not in stderr, stderr[-2000:]
    done = json.loads((out / "metrics.json").read_text())["steps"]
    assert len(done) >= 2 and (out / "last").resolve().name == f"{done[-1]['step']:04d}"
    dump = load_dump(str(out / "last" / "rollout"))
    assert not isinstance(dump, dict)
    check_engine_dump(dump)
    assert not list((out / "steps").glob(".*")), list((out / "steps").iterdir())  # no step half-written
    assert sorted(p.name for p in (out / "steps").iterdir() if not p.name.startswith(".")) == [f"{done[-1]['step']:04d}"]
