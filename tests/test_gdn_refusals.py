"""GatedDeltaNet configs the engine or the contract cannot run are refused up front, in one line, nothing written: the
adapter's ``refuses`` (engines/vllm/gdn_probe.gdn_config_refusal), which the rollout, the engine server and the
on-policy loop all ask before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

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
