"""Mixture-of-experts against a live vLLM: the engine's routes recorded, the contract bitwise, replay where it is not.

Three checkpoints written from configs built here, at sizes no issue names: a Qwen3-MoE (12 experts, 3 per token,
renormalised), another (9 experts, 2 per token, not renormalised, an expert width of 48 the engine pads to 64) and a
Qwen2-MoE (10 experts, 2 per token, not renormalised, a shared expert with its 1-wide gate). One rollout each::

    the dump holds the engine's routes             every forward step, every MoE layer, one route per row fed
    as-is, the routes are compared per layer       every token the engine computed, counted, a share reported
    replayed, every route is the engine's          0 tokens routed otherwise, in process and on FSDP2 x 2
    under the contract                             every log-prob bitwise, every route the engine's: eager, and
                                                   Inductor on FSDP2 x 2; the on-policy loop's mismatch 0 every step
    a form the contract does not follow            (a dump whose probe read none) refused up front with the probe's
                                                   reason, --replay-routes offered in the same line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fx_precision.dump import load_dump

CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
COMMON = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}  # fmt: skip
CONFIGS = {
    "qwen3-moe": {**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 32,
                  "moe_intermediate_size": 64, "num_experts": 12, "num_experts_per_tok": 3, "norm_topk_prob": True},
    "qwen3-moe-padded": {**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 32,
                         "moe_intermediate_size": 48, "num_experts": 9, "num_experts_per_tok": 2, "norm_topk_prob": False},
    "qwen2-moe": {**COMMON, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 96, "num_experts": 10, "num_experts_per_tok": 2, "norm_topk_prob": False},
}  # fmt: skip
PROMPT_LENS, SAMPLES, MAX_TOKENS = "11,70", 2, 5


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"fx-precision {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("moe")
    made = {}
    for name, config in CONFIGS.items():
        (root / f"{name}.json").write_text(json.dumps(config))
        run("checkpoint", "--config", str(root / f"{name}.json"), "--layers", "2", "--out", str(root / f"ckpt-{name}"))
        run("rollout", "--launch", "eager",
                "--model", str(root / f"ckpt-{name}"), "--prompt-lens", PROMPT_LENS, "--samples", str(SAMPLES), "--max-tokens",
            str(MAX_TOKENS), "--temperature", "1.0", "--out", str(root / f"dump-{name}"))  # fmt: skip
        made[name] = (root / f"ckpt-{name}", root / f"dump-{name}")
    return made


def compare(made: tuple[Path, Path], *extra: str) -> dict[str, Any]:
    return json.loads(run("compare", "--model", str(made[0]), "--rollout", str(made[1]), "--json", *extra).stdout)


def computed_rows() -> int:
    """Every token of every sequence but its last sampled one (never fed)."""
    return SAMPLES * sum(int(n) + MAX_TOKENS - 1 for n in PROMPT_LENS.split(","))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_dump_holds_the_engines_route_of_every_row_of_every_step(rollouts: dict[str, tuple[Path, Path]], name: str) -> None:
    engine = load_dump(str(rollouts[name][1])).engine or {}
    config = CONFIGS[name]
    assert engine["moe"] == {"layers": [f"model.layers.{i}.mlp.experts" for i in range(2)], "experts": config["num_experts"],
                             "top_k": config["num_experts_per_tok"]}  # fmt: skip
    assert len(engine["routes"]) == len(engine["steps"])
    for step, routes in zip(engine["steps"], engine["routes"], strict=True):
        assert len(routes) == 2
        for layer in routes:
            assert len(layer) == len(step)
            assert all(len(set(r)) == config["num_experts_per_tok"] and all(0 <= e < config["num_experts"] for e in r) for r in layer)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_as_is_the_routes_are_compared_per_layer_and_replayed_every_one_is_the_engines(rollouts: dict[str, tuple[Path, Path]],
                                                                                       name: str) -> None:  # fmt: skip
    as_is = compare(rollouts[name])
    routes = as_is["routes"]
    assert not routes["replayed"] and [r["layer"] for r in routes["layers"]] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    for layer in routes["layers"]:
        assert layer["tokens"] == computed_rows() and 0 <= layer["differ"] <= layer["tokens"]
        assert layer["share"] == layer["differ"] / layer["tokens"]
    replayed = compare(rollouts[name], "--replay-routes")
    assert replayed["routes"]["replayed"]
    assert [(r["tokens"], r["differ"]) for r in replayed["routes"]["layers"]] == [(computed_rows(), 0)] * 2
    assert replayed["logprob"]["comparable"] and replayed["logprob"]["max"] >= 0  # the gap left, reported


def test_replay_holds_on_fsdp2_ranks(rollouts: dict[str, tuple[Path, Path]]) -> None:
    replayed = compare(rollouts["qwen3-moe"], "--replay-routes", "--world-size", "2")
    assert [(r["tokens"], r["differ"]) for r in replayed["routes"]["layers"]] == [(computed_rows(), 0)] * 2


FSDP2 = ("--compiled", "--world-size", "2")
CONTRACT_RUNS = [("qwen3-moe", ()), ("qwen3-moe", FSDP2), ("qwen3-moe-padded", ()), ("qwen2-moe", ()), ("qwen2-moe", FSDP2)]


RUN_IDS = ["qwen3", "qwen3-inductor-fsdp2", "qwen3-padded-unnormalised", "qwen2-shared", "qwen2-shared-inductor-fsdp2"]


@pytest.mark.parametrize(("name", "extra"), CONTRACT_RUNS, ids=RUN_IDS)
def test_under_the_contract_every_log_prob_is_bitwise_and_every_route_the_engines(rollouts: dict[str, tuple[Path, Path]], name: str,
                                                                                  extra: tuple[str, ...]) -> None:  # fmt: skip
    report = compare(rollouts[name], "--contract", "vllm", *extra)
    assert report["contract"]["moe"]["kernel"] == "vec" and not [c for c, _ in report["contract"]["unmatched"]]
    lp = report["logprob"]
    assert lp["comparable"] and lp["max"] == 0 and lp["bitwise_share"] == 1.0 and lp["tokens"] == computed_rows()
    assert report["routes"]["routed_by"] == "contract"
    assert [(r["tokens"], r["differ"]) for r in report["routes"]["layers"]] == [(computed_rows(), 0)] * 2


def test_a_form_the_contract_does_not_follow_is_refused_up_front_and_replay_offered(rollouts: dict[str, tuple[Path, Path]],
                                                                                   tmp_path: Path) -> None:  # fmt: skip
    """A dump whose probe matched no MoE kernel (as on an AMX CPU, whose engine runs its AMX experts kernel, or a router
    with grouped top-k): the contract is refused before any model is built, with the probe's reason and replay."""
    import shutil

    checkpoint, dump = rollouts["qwen3-moe"]
    edited = tmp_path / "dump"
    shutil.copytree(dump, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    why = "the engine's MoE is not of the form the contract follows: the portable (vec) fused experts (experts isa amx)"
    manifest["contract"]["moe"] = None
    manifest["contract"]["unmatched"].append(["moe", why])
    (edited / "manifest.json").write_text(json.dumps(manifest))
    done = run("compare", "--model", str(checkpoint), "--rollout", str(edited), "--contract", "vllm", check=False)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "mixture of experts" in last and "isa amx" in last and "--replay-routes" in last, last
    assert "Loading weights" not in done.stderr and "Traceback" not in done.stderr


def test_dense_layers_among_moe_layers_are_followed_too(tmp_path: Path) -> None:
    """A dense first layer, then MoE layers with one expert per token (Qwen3-MoE's ``mlp_only_layers``; DeepSeek's first
    dense layers are the same form): the probe reads each kind of linear where it first appears (the router lives in
    layer 1 only), and the contract is bitwise with Inductor."""
    config = {**CONFIGS["qwen3-moe"], "mlp_only_layers": [0], "num_experts": 16, "num_experts_per_tok": 1, "moe_intermediate_size": 32}
    (tmp_path / "mixed.json").write_text(json.dumps(config))
    checkpoint, dump = tmp_path / "ckpt", tmp_path / "dump"
    run("checkpoint", "--config", str(tmp_path / "mixed.json"), "--layers", "2", "--out", str(checkpoint))
    run("rollout", "--launch", "eager",
            "--model", str(checkpoint), "--prompt-lens", "9,50", "--samples", "2", "--max-tokens", "4", "--temperature", "1.0",
        "--out", str(dump))  # fmt: skip
    read = {(call["out_features"], call["in_features"]) for call in load_dump(str(dump)).contract["linears"]["calls"]}
    assert (16, 128) in read, sorted(read)  # layer 1's router, 16 experts over the hidden size
    report = compare((checkpoint, dump), "--contract", "vllm", "--compiled")
    assert report["logprob"]["bitwise_share"] == 1.0 and report["logprob"]["tokens"] == 2 * (9 + 50 + 2 * 3)
    assert [(r["layer"], r["differ"]) for r in report["routes"]["layers"]] == [("model.layers.1.mlp.experts", 0)]


def test_the_comparator_names_the_router_or_the_experts_and_the_token_an_moe_block_parts_at(
        rollouts: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:  # fmt: skip
    """The engine's module records, bitwise under the contract, then one of its MoE block outputs changed at one token
    (an expert kernel that parts there), and then also its routes of that layer (a router that parts): the comparator's
    first origin is the block, named as its experts at that token, then as its router at the first token routed
    otherwise, with both sides' experts."""
    import shutil

    import torch

    checkpoint = rollouts["qwen3-moe"][0]
    dump = tmp_path / "modules"
    run("rollout", "--launch", "eager",
            "--model", str(checkpoint), "--prompt-lens", "11,40", "--samples", "2", "--max-tokens", "4", "--temperature", "1.0",
        "--modules", "--out", str(dump))  # fmt: skip
    clean = compare((checkpoint, dump), "--contract", "vllm")
    assert clean["logprob"]["bitwise_share"] == 1.0 and clean["first_origin"] is None and "moe_origin" not in clean
    experts, router = tmp_path / "experts", tmp_path / "router"
    shutil.copytree(dump, experts)
    manifest = json.loads((experts / "manifest.json").read_text())
    out = next(r for r in manifest["records"] if (r["fqn"], r["call"], r["io"]) == ("model.layers.1.mlp", 1, "out"))
    values = torch.load(experts / out["file"], weights_only=True)
    values[0, 5, 3] = values[0, 5, 3] * 1.5 + 0.01
    torch.save(values, experts / out["file"])
    named = compare((checkpoint, experts), "--contract", "vllm")["moe_origin"]
    assert (named["block"], named["part"], named["sequence"], named["token"], named["routed_alike"]) == (
        "model.layers.1.mlp", "experts", 1, 5, True)  # fmt: skip
    shutil.copytree(experts, router)
    experts_count = manifest["engine"]["moe"]["experts"]
    for step in manifest["engine"]["routes"]:  # layer 1's every route moved one expert on: token 0 parts first
        step[1] = [[(e + 1) % experts_count for e in row] for row in step[1]]
    (router / "manifest.json").write_text(json.dumps(manifest))
    named = compare((checkpoint, router), "--contract", "vllm")["moe_origin"]
    assert (named["block"], named["part"], named["sequence"], named["token"]) == ("model.layers.1.mlp", "router", 1, 0)
    assert named["engine"] == sorted((e + 1) % experts_count for e in named["train"])


def test_onpolicy_under_the_contract_and_with_replay(rollouts: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    checkpoint = rollouts["qwen3-moe"][0]
    common = ["onpolicy", "--model", str(checkpoint), "--samples", "2", "--max-tokens", "4", "--prompt-lens", "9,14", "--steps", "2",
              "--world-size", "2", "--compiled", "--engine-launch", "eager"]  # fmt: skip
    runs = {}
    for name, extra in (("contract", ()), ("replayed", ("--contract", "none", "--replay-routes", "--mode", "audit"))):
        out = tmp_path / name
        run(*common, "--out", str(out), *extra, "--json", str(out) + ".json")
        runs[name] = json.loads(Path(str(out) + ".json").read_text())
    assert runs["contract"]["stopped"] is None and "experts" in runs["contract"]["contract"]
    for step in runs["contract"]["steps"]:
        assert step["tokens"] == 2 * 2 * 4 and step["mismatches"] == 0 and step["max_delta"] == 0.0, step
    assert runs["replayed"]["config"]["replay_routes"] and len(runs["replayed"]["steps"]) == 2
    for step in runs["replayed"]["steps"]:
        assert step["tokens"] == 2 * 2 * 4 and 0 <= step["mismatches"] <= step["tokens"]  # the gap left, certified per token
