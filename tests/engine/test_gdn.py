"""GatedDeltaNet (Qwen3-Next; Qwen3.5 shares vLLM's layer) against the real engine.

the kernels      vLLM's own GDN ops (prefill gating, chunk rule over pieces with and without a state, the decode
                 kernel, the conv's decode update and prefill) equal the contract's bit for bit at head counts,
                 dims and state dtypes the probe never ran, in each build this CPU can load: the portable ones
                 (_C_AVX2, every x86 CPU; _C_AVX512, its decode's multiply-adds fused, every AVX-512 CPU), each in a
                 process of its own, and the AVX-512 one (_C: packed C++ conv, exp_u20, VRCP14PS, libtorch's brgemm)
                 on an AVX-512 BF16 CPU without AMX
end to end       a Qwen3-Next hybrid (linear, full, linear, linear; every MLP an MoE block) rolled out by the eager
                 engine and by the engine as its users launch it (compiled: its gated norm and router are
                 Inductor's code): compare --contract vllm finds every sampled log-prob bitwise, each GDN layer
                 rewritten (core and gated norm)
where the engine runs what the contract does not follow (an AMX CPU's fused experts), the comparison is refused in
one line naming the op class, never reported (tests/engine/test_cpu_families.py runs the hybrid as each family)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fx_precision.engines.vllm.cpu_family import CpuFamily
from fx_precision.tools.checkpoint import write_tiny_checkpoint
from tests.engine.families import PORTABLE_GDN_BUILDS, skip_unless_runnable

CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
SAMPLES, MAX_TOKENS, PROMPT_LENS = 2, 6, "5,70,133"
AVX512 = torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()  # its _C build, no AMX tiles
# the contract follows the build vLLM loads on this CPU (_C_AVX2, _C_AVX512, _C), and the hybrids' experts; on an AMX CPU
# the GDN GEMMs are libtorch's brgemm on tiles (the probe holds them there, at run time) and the fused experts SGL's AMX
# kernel, not followed: refused
FOLLOWED = not torch.cpu._is_amx_tile_supported()
REFUSED_BY = re.compile(r"\b(gdn|moe)\b")  # where not followed: the op class that refused, in one line


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"fx-precision {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


@pytest.mark.parametrize("family", list(PORTABLE_GDN_BUILDS), ids=str)
def test_each_portable_builds_gdn_kernels_equal_the_contracts_at_held_out_shapes(family: CpuFamily) -> None:
    """vLLM's generic GDN code as each of its portable builds compiled it: _C_AVX2 (every multiply and add rounded apart)
    and _C_AVX512 (the decode recurrence's multiply-adds fused by the compiler), loaded in a process of their own (the
    builds register the same op names) as the engine run as that family loads them. Each equals its contract kernels
    bit for bit, and the other form's decode parts from it wherever the state is fp32 (a bf16 state's rounding can
    hide a fused multiply-add's last bit at a small shape): the probe tells the two apart."""
    skip_unless_runnable(family)
    shapes = ["1,2,64,4,bf16", "2,2,128,4,fp32", "3,6,128,3,bf16", "2,8,64,4,fp32"]
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "gdn_ops_check.py"), str(family), *shapes], capture_output=True,
                          text=True, env=ENV, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    library, form = PORTABLE_GDN_BUILDS[family]
    assert library in result["kernels"] and result["build"] == form, result
    assert all(row["differ"] == [] for row in result["shapes"]), result["shapes"]
    fp32_state = [row for row in result["shapes"] if row["shape"].endswith("fp32")]
    assert fp32_state and all("decode rule" in row["differ_other"] for row in fp32_state), result["shapes"]


@pytest.mark.skipif(not AVX512, reason="vLLM's AVX-512 build (_C) runs its GDN GEMMs without AMX tiles only on an AVX-512 BF16 "
                    "CPU without AMX (on an AMX CPU the probe holds the tiles at run time); this CPU runs another")  # fmt: skip
@pytest.mark.parametrize(("heads", "value_heads", "dim"), [(1, 2, 64), (3, 6, 128), (2, 8, 64), (16, 32, 128), (4, 48, 64)])
def test_the_engines_avx512_gdn_kernels_equal_the_contracts_at_held_out_shapes(heads: int, value_heads: int, dim: int) -> None:
    """32 or more value heads: the prefill gating's vector blocks of 32 (exp_u20, SLEEF's log, VRCP14PS) beside its
    scalar rest; 16 / 32 at 128: Qwen3-Next-80B's and Qwen3.5's linear heads."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the AVX-512 build's ops (_C), as the engine loads them

    from fx_precision.engines.vllm.gdn_probe import _differing512

    differ = _differing512(heads, value_heads, dim, torch.Generator().manual_seed(heads * 1000 + dim))
    assert differ == [], differ


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gdn")
    checkpoint = write_tiny_checkpoint("qwen3-next", root / "ckpt", seed=23)
    for launch in ("eager", "defaults"):
        run("rollout", "--model", str(checkpoint), "--prompt-lens", PROMPT_LENS, "--samples", str(SAMPLES), "--max-tokens",
            str(MAX_TOKENS), "--seed", "3", "--launch", launch, "--out", str(root / launch))  # fmt: skip
    return {"checkpoint": checkpoint, "eager": root / "eager", "defaults": root / "defaults"}


@pytest.mark.parametrize("launch", ["eager", "defaults"])
def test_a_qwen3_next_hybrid_is_bitwise_against_the_engine(hybrid: dict[str, Path], launch: str) -> None:
    compiled = ("--compiled",) if launch == "defaults" else ()
    done = run("compare", "--model", str(hybrid["checkpoint"]), "--rollout", str(hybrid[launch]), "--contract", "vllm",
               *compiled, "--json", check=FOLLOWED)  # fmt: skip
    if not FOLLOWED:  # a build the contract does not follow: refused in one line, naming the op class
        assert done.returncode != 0 and REFUSED_BY.search(done.stderr.lower()) and "Traceback" not in done.stderr, done.stderr[-2000:]
        return
    report = json.loads(done.stdout)
    config = json.loads((hybrid["checkpoint"] / "config.json").read_text())
    linear_layers = config["layer_types"].count("linear_attention")
    rewritten = re.search(r"'engine-gdn': (\d+)", report["a"])
    assert rewritten is not None and int(rewritten.group(1)) == 2 * linear_layers, report["a"]  # each layer's core and gated norm
    lp = report["logprob"]
    assert lp["generated"]["tokens"] == 3 * SAMPLES * MAX_TOKENS
    assert lp["generated"]["bitwise_share"] == 1.0, lp


def test_a_qwen3_5_rollout_is_refused_in_one_line_where_vllm_cannot_import_it(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed in this engine environment: vLLM's Qwen3.5 module imports")
    checkpoint = write_tiny_checkpoint("qwen3.5", tmp_path / "ckpt", seed=1)
    done = run("rollout", "--model", str(checkpoint), "--out", str(tmp_path / "dump"), check=False)
    assert done.returncode != 0 and "torchvision" in done.stderr and "Qwen3-Next" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "dump").exists()  # refused before the engine starts


def test_qwen3_5_moe_is_bitwise_against_the_engines_gdn_through_its_qwen3_next_layout(tmp_path: Path) -> None:
    """Qwen3.5-MoE's training side (split projections in_proj_qkv / z / b / a) against the engine's GDN: the engine runs
    the same weights laid out as Qwen3-Next (vLLM's Qwen3.5 layer is Qwen3-Next's), the training side loads the Qwen3.5-MoE
    checkpoint, and the dump's weights digest ties the two (the relaid tensors digest to what the engine loaded).
    Runs wherever Qwen3-Next does, torchvision or not."""
    from fx_precision.tools.gdn_layout import write_qwen3_next_layout

    qwen3_5 = write_tiny_checkpoint("qwen3.5-moe", tmp_path / "qwen3.5-moe", seed=31)
    next_layout = write_qwen3_next_layout(qwen3_5, tmp_path / "as-qwen3-next")
    run("rollout", "--model", str(next_layout), "--prompt-lens", "6,81", "--samples", str(SAMPLES), "--max-tokens", str(MAX_TOKENS),
        "--seed", "5", "--launch", "eager", "--out", str(tmp_path / "dump"))  # fmt: skip
    done = run("compare", "--model", str(qwen3_5), "--rollout", str(tmp_path / "dump"), "--contract", "vllm", "--compiled", "--json",
               check=FOLLOWED)  # fmt: skip
    if not FOLLOWED:
        assert done.returncode != 0 and REFUSED_BY.search(done.stderr.lower()) and "Traceback" not in done.stderr, done.stderr[-2000:]
        return
    report = json.loads(done.stdout)
    linear_layers = json.loads((qwen3_5 / "config.json").read_text())["layer_types"].count("linear_attention")
    rewritten = re.search(r"'engine-gdn': (\d+)", report["a"])  # Qwen3.5's split projections found, each layer rewritten
    assert rewritten is not None and int(rewritten.group(1)) == 2 * linear_layers, report["a"]
    lp = report["logprob"]
    assert lp["generated"]["tokens"] == 2 * SAMPLES * MAX_TOKENS and lp["generated"]["bitwise_share"] == 1.0, lp
    other = write_tiny_checkpoint("qwen3.5-moe", tmp_path / "other", seed=32)  # other weights: refused, never compared
    done = run("compare", "--model", str(other), "--rollout", str(tmp_path / "dump"), "--contract", "vllm", check=False)
    assert done.returncode != 0 and "other weights" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_hybrids_rollout_at_the_defaults_is_what_vllms_own_api_returns(hybrid: dict[str, Path], tmp_path: Path) -> None:
    """The dump of the engine at its defaults holds what an independent ``LLM(model, dtype="bfloat16", seed=S).generate``
    returns for the same prompts (tests/engine/direct_generate.py: nothing of the project in its path), bit for bit."""
    from fx_precision.dump import load_dump
    from tests.engine.direct_check import assert_dump_is_vllms_own

    dump = load_dump(str(hybrid["defaults"]))
    assert not isinstance(dump, dict)
    assert_dump_is_vllms_own(dump, hybrid["checkpoint"], tmp_path, MAX_TOKENS, 3, SAMPLES, "1.0")
