"""The benchmark and its kernel census, on the hand-written decoder (fast; no timing asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from fx_precision.tools.kernel_census import parse_wrapper
from tests.cli import run_cli

SAMPLE = """
cpp_fused_0 = async_compile.cpp_pybinding(['const int64_t*', 'const float*', 'float*', 'at::BFloat16*'], r'''
''')
    def call(self, args):
        assert_size_stride(primals_1, (2, 8), (8, 1), 'input')
        assert_size_stride(primals_2, (128, 32), (32, 1), 'input')
        buf0 = empty_strided_cpu((2, 8, 32), (256, 32, 1), torch.float32)
        buf1 = empty_strided_cpu((16, 32), (32, 1), torch.bfloat16)
        cpp_fused_0(primals_1, primals_2, buf0, buf1)
        buf2 = empty_strided_cpu((16, 16), (16, 1), torch.bfloat16)
        extern_kernels.mm(buf1, reinterpret_tensor(buf1, (32, 16), (1, 32), 0), out=buf2)
        buf3 = reinterpret_tensor(buf2, (2, 8, 16), (128, 16, 1), 0); del buf2  # reuse
"""


def test_wrapper_parse_reads_signatures_shapes_and_externs() -> None:
    census = parse_wrapper(SAMPLE)
    (kernel,) = census.generated()
    assert [(a.buffer, a.dtype, a.numel, a.write) for a in kernel.args] == [
        ("primals_1", torch.int64, 16, False),
        ("primals_2", torch.float32, 4096, False),
        ("buf0", torch.float32, 512, True),
        ("buf1", torch.bfloat16, 512, True),
    ]
    assert census.bytes_by_dtype(write=True) == {"fp32": 2048, "bf16": 1024}
    (mm,) = census.externs()
    assert mm.name == "extern_kernels.mm" and [a.write for a in mm.args] == [False, False, True]
    acts = census.activation_buffers(16, {(128, 32)}, widths={32})
    assert acts == {"buf0", "buf1"}  # primals_2 is a parameter; primals_1 has one value per token
    assert [k.name for k in census.kernels_touching(acts, torch.float32)] == ["cpp_fused_0"]


def test_bench_cli_on_the_hand_written_decoder(tmp_path: object) -> None:
    """The quick path on a decoder whose embedding is called ``tok_embeddings``: the plan variant
    finds it by role (``*embed_tokens`` would select nothing)."""
    out = f"{tmp_path}/bench.json"
    model = "tests.lint_models:TokEmbeddingsDecoder"
    result = run_cli("bench", "--quick", "--model", model, "--batch", "2", "--seq-len", "8", "--steps", "1", "--json", out)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.load(open(out))
    rows = {r["variant"]: r for r in data["variants"]}
    assert list(rows) == [
        "eager as-is",
        "eager both fixes",
        "inductor",
        "precision_backend + plan",
        "precision_backend",
        "pure bf16 limit",
        "per-block backend",
        "per-block backend + eager fix",
    ]
    assert {"cpu", "cpu_native_bf16", "torch"} <= set(data["machine"])
    for r in rows.values():
        assert r["step_seconds"]["n"] == 1 and r["tokens_per_second"] > 0 and "time_vs_inductor" in r
    base, limit = rows["inductor"]["kernels"], rows["pure bf16 limit"]["kernels"]
    assert base["kernels_touching_fp32_activations"] > 0  # the leak, in kernels
    for name in ("precision_backend + plan", "precision_backend"):
        r = rows[name]
        k = r["kernels"]
        assert k["kernels_touching_fp32_activations"] == 0, name
        assert k["activation_bytes_total"] < base["activation_bytes_total"], name
        assert k["activation_bytes_total"] <= 1.10 * limit["activation_bytes_total"], name
        assert r["saved_activation_bytes_total"] < rows["inductor"]["saved_activation_bytes_total"], name
        assert r["pass_seconds"] > 0 and r["compile_seconds"] > 0
    assert "fp32-stream kernels" in result.stdout and "precision_backend + plan" in result.stdout
    # each block compiled alone: the eager embedding's fp32 stream reaches every block, unless the derived hooks narrow it
    assert rows["per-block backend"]["kernels"]["kernels_touching_fp32_activations"] > 0
    assert rows["per-block backend + eager fix"]["kernels"]["kernels_touching_fp32_activations"] == 0
    gathered = [c for c in rows["precision_backend + plan"]["casts"] if c["kind"] == "gather-emulation"]
    assert [c["of"] for c in gathered] == ["tok_embeddings.weight"]


def test_the_entry_points_run_the_command_line() -> None:
    """``python -m fx_precision`` and the ``fx-precision`` script are the CLI (every other test calls ``main`` in process)."""
    script = shutil.which("fx-precision") or str(Path(sys.executable).with_name("fx-precision"))
    for command in ([sys.executable, "-m", "fx_precision"], [script]):
        done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert all(verb in done.stdout for verb in ("demo", "plan", "lint", "bench", "compare", "rollout"))
