"""Checkpoint directories as published: a config's dtype field names the file's storage, not what the run analyses.

Every published config names its weight dtype (``"torch_dtype": "bfloat16"``, or ``"dtype"``, at the top
level or in ``text_config``). A training run loads it into fp32 masters before FSDP2 gathers them, so
``lint``, ``plan``, ``census`` and the comparator build at the master dtype, whatever the field says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fx_precision as fxp
from fx_precision.checkpoints import build_from_config, read_checkpoint_config
from fx_precision.errors import PrecisionError
from fx_precision.tools.cli import main
from fx_precision.tools.zoo import build_model

CONFIGS = Path(__file__).parent / "configs"
PUBLISHED = ["llama-3.1-8b", "qwen3-4b", "phi-3-mini-4k", "qwen3.5-4b-vl"]  # torch_dtype / text_config.dtype bf16


def _copy(name: str, tmp: Path, *, strip_dtype: bool, layers: int) -> Path:
    """The published config with fewer layers (the findings repeat per layer), with or without its dtype field."""
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = layers
    if strip_dtype:
        for table in (raw, text):
            table.pop("torch_dtype", None)
            table.pop("dtype", None)
    folder = tmp / f"{name}-{'plain' if strip_dtype else 'published'}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _lint_findings(path: Path) -> list[tuple[str, str, str, int]]:
    model = build_model(str(path), device="meta")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    policy = fxp.PrecisionPolicy(compute=torch.bfloat16)
    report = fxp.lint(model, torch.zeros(1, 8, dtype=torch.long), policy=policy, plan=policy.plan(model), use_cache=False)
    return sorted((f.code, f.kind, f.module, f.round) for f in report.findings)


@pytest.mark.needs_transformers
@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_dtype_field_changes_no_finding(name: str, tmp_path: Path) -> None:
    layers = 4 if name.startswith("qwen3.5") else 2  # Qwen3.5: one full-attention layer in every four
    published = _lint_findings(_copy(name, tmp_path, strip_dtype=False, layers=layers))
    plain = _lint_findings(_copy(name, tmp_path, strip_dtype=True, layers=layers))
    assert published == plain
    codes = [f[0] for f in published]
    assert "FXP202" not in codes  # no plan-mismatch flood
    assert ("FXP001", "uncovered-op", "model.embed_tokens", 0) in published  # the embedding leak
    if not name.startswith("qwen3.5"):  # Llama-style norms: every one a promotion masked by the embedding
        norms = [f for f in published if f[0] == "FXP002" and f[3] == 1]
        assert len(norms) == 2 * layers + 1


@pytest.mark.needs_transformers
def test_the_config_says_what_it_stores_and_the_model_is_built_at_the_master_dtype() -> None:
    cc = read_checkpoint_config(CONFIGS / "qwen3.5-4b-vl")
    assert (cc.stored, cc.stored_field) == (torch.bfloat16, "text_config.dtype")
    assert cc.config.model_type == "qwen3_5_text"  # the text tower of a multimodal checkpoint
    with torch.device("meta"):
        assert {p.dtype for p in build_from_config(cc).parameters()} == {torch.float32}
        assert {p.dtype for p in build_from_config(cc, dtype=None).parameters()} == {torch.bfloat16}  # --master none: as stored
    assert "stores bf16 (text_config.dtype); built at fp32" in cc.describe(torch.float32)
    phi = read_checkpoint_config(CONFIGS / "phi-3-mini-4k")
    assert phi.remote_code and "auto_map ignored" in phi.describe(torch.float32)


@pytest.mark.needs_transformers
def test_plan_cli_builds_a_published_config_at_the_master_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(CONFIGS / "qwen3-4b"), "--rules", "*embed_tokens=bf16", "--master", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_source"].endswith("stores bf16 (torch_dtype); built at fp32")
    assert {p["master"] for p in data["params"].values()} == {"fp32"}


def _write(tmp: Path, raw: dict[str, object]) -> Path:
    (tmp / "config.json").write_text(json.dumps(raw))
    return tmp


@pytest.mark.needs_transformers
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": "phi3_custom"}, "runs no code from a checkpoint"),
        ({"quantization_config": {"quant_method": "fp8"}}, "a quantised checkpoint"),
        ({"vocab_size": 0}, "vocab_size = 0; it must be a positive integer"),
        ({"num_hidden_layers": 10**6}, "over the limit of 1024"),
    ],
)
def test_a_config_the_project_cannot_honour_is_one_line_exit_2(
    change: dict[str, object], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = {**json.loads((CONFIGS / "phi-3-mini-4k" / "config.json").read_text()), **change}
    folder = _write(tmp_path, raw)
    with pytest.raises(PrecisionError, match=needle):
        read_checkpoint_config(folder)
    assert main(["lint", "--model", str(folder), "--json"]) == 2
    out, err = capsys.readouterr()
    assert needle in json.loads(out)["error"] and needle in err and "Traceback" not in err


def test_a_directory_without_config_json_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.needs_transformers
def test_a_model_loaded_at_another_dtype_than_its_masters_is_one_plan_mismatch(tmp_path: Path) -> None:
    """Built as stored (bf16) under a plan that holds fp32 masters: every parameter mismatches for one
    reason, which FXP202 says once, with the count and the fix."""
    model = build_model(str(_copy("qwen3-4b", tmp_path, strip_dtype=False, layers=2)), device="meta", dtype=None)
    plan = fxp.compile_precision(model, fxp.PrecisionSpec(), default_gather="fp32", default_master="fp32")
    report = fxp.lint(model, torch.zeros(1, 8, dtype=torch.long), policy=fxp.PrecisionPolicy(compute=torch.bfloat16), plan=plan)
    (mismatch,) = report.by_kind("plan-mismatch")
    n = sum(1 for p in model.parameters() if p.is_floating_point())
    assert mismatch.message.startswith(f"{n} parameters (") and "built or loaded at bf16" in mismatch.message
    assert "torch.float32" in (mismatch.suggestion or "")
