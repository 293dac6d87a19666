"""GatedDeltaNet configs the engine or the contract cannot run are refused up front, in one line, nothing written: the
adapter's ``refuses`` (engines/vllm/gdn_probe.gdn_config_refusal), which the rollout, the engine server and the
on-policy loop all ask before anything starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fx_precision.contract.gdn_form import KERNELS
from fx_precision.engines import engine_adapter
from fx_precision.engines.vllm.gdn_probe import gdn_config_refusal

GOOD = {"model_type": "qwen3_next", "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "num_experts": 8, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"linear_key_head_dim": 32, "linear_value_head_dim": 32}, "linear_key_head_dim 32, linear_value_head_dim 32"),
     ({"linear_value_head_dim": 64}, "one head dim for both, 64 or 128"),
     ({"linear_num_value_heads": 5}, "linear_num_value_heads 5 must be a multiple of linear_num_key_heads 2"),
     ({"mlp_only_layers": [0, 1, 2, 3]}, "no MoE layer"), ({"num_experts": 0}, "no MoE layer"),
     ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "including mamba"),
     ({"layer_types": ["linear_attention", "full_attention"]}, "got 2 entries")],
)  # fmt: skip
def test_a_gdn_config_the_engine_cannot_run_is_refused_in_one_line(change: dict[str, Any], needle: str) -> None:
    config = SimpleNamespace(**{**GOOD, **change})
    why = engine_adapter("vllm").refuses(config)
    assert why is not None and needle in why and "\n" not in why, why


def test_what_the_engine_runs_is_not_refused() -> None:
    assert gdn_config_refusal(SimpleNamespace(**GOOD)) is None
    assert gdn_config_refusal(SimpleNamespace(**{**GOOD, "decoder_sparse_step": 2, "mlp_only_layers": [3]})) is None  # layer 1 MoE
    dense_qwen3_5 = {**GOOD, "model_type": "qwen3_5_text", "num_experts": 0}  # Qwen3.5 needs no MoE layer
    assert gdn_config_refusal(SimpleNamespace(text_config=SimpleNamespace(**dense_qwen3_5))) is None
    assert gdn_config_refusal(SimpleNamespace(model_type="llama", num_hidden_layers=2)) is None  # no GDN layer


@pytest.mark.needs_transformers
def test_onpolicy_refuses_a_bad_gdn_checkpoint_before_anything_starts(tmp_path: Path) -> None:
    from fx_precision.tools.checkpoint import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint("qwen3-next", tmp_path / "ckpt", seed=2)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "linear_num_value_heads": 3}))
    done = subprocess.run([sys.executable, "-m", "fx_precision.tools.cli", "onpolicy", "--model", str(checkpoint), "--out",
                           str(tmp_path / "run"), "--steps", "1"], capture_output=True, text=True, check=False)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "linear_num_value_heads 3 must be a multiple" in last and "Traceback" not in done.stderr, last
    assert not (tmp_path / "run").exists()
    (checkpoint / "config.json").write_text(json.dumps(config))  # a good one, trained eagerly at a micro-batch of 4: refused
    done = subprocess.run([sys.executable, "-m", "fx_precision.tools.cli", "onpolicy", "--model", str(checkpoint), "--out",
                           str(tmp_path / "run"), "--steps", "1", "--no-compiled", "--engine-launch", "eager"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "--micro-batch 1" in last and not (tmp_path / "run").exists(), last


@pytest.mark.parametrize(
    ("kernels", "avx512_bf16", "amx", "state", "followed"),
    [
        ("AVX2 (_C_AVX2)", False, False, torch.bfloat16, "portable"),  # an AVX2 CPU (or --isa avx2): the portable build
        ("AVX512+BF16 (_C)", True, False, torch.float32, "avx512"),  # Zen 4 / Zen 5 at the defaults
        ("AVX512+BF16 (_C)", True, True, torch.float32, "avx512"),  # Sapphire Rapids: the same build, torch's brgemm on AMX tiles
        ("AVX512+BF16 (_C)", True, False, torch.bfloat16, r"bfloat16 SSM state cache: followed with an fp32 one"),
        ("AVX512 (_C_AVX512)", False, False, torch.float32, "portable-fma"),  # Skylake-SP to Ice Lake (or --isa avx512)
        ("AVX512 (_C_AVX512)", False, False, torch.bfloat16, "portable-fma"),  # its state cache in either dtype
        ("AVX512 (_C_AVX512)", True, False, torch.float32, r"AVX512-BF16 on, a pairing vLLM never loads"),
        ("AVX2 (_C_AVX2)", True, False, torch.float32, r"C\+\+ conv kernels on this CPU \(AVX-512 BF16\) with its _C_AVX2"),
    ],
)
def test_the_gdn_build_followed_is_the_one_the_engine_loaded_on_this_cpu(
    monkeypatch: pytest.MonkeyPatch, kernels: str, avx512_bf16: bool, amx: bool, state: torch.dtype, followed: str
) -> None:
    """Which of vLLM's GDN kernel builds the probe follows, by the build the engine loaded and what the CPU runs (vLLM's own
    tests: AVX-512 BF16 for its C++ conv; an AMX CPU runs the same build, its GEMMs libtorch's brgemm on tiles, which the
    contract calls too): a followed build is named, any other is one line why."""
    from fx_precision.engines.vllm.gdn_probe import _build_followed

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    got = _build_followed(kernels, state)
    if followed in KERNELS:
        assert got == followed
    else:
        assert got not in KERNELS and re.search(followed, got), got
