"""The graph dtype lint: every finding code fires where it should and stays quiet where it should not."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import sympy
import torch

import fx_precision as fxp
from fx_precision.errors import PrecisionError
from fx_precision.lint import LintReport, lint
from tests import lint_models as lm
from tests.cli import run_cli

BF16 = torch.bfloat16


def bf16_lint(model: torch.nn.Module, *args: object, **kwargs: object) -> LintReport:
    with torch.autocast("cpu", dtype=BF16):
        return lint(model, *args, **kwargs)


def kinds(report: LintReport) -> list[str]:
    return sorted(f.kind for f in report.findings)


def x16() -> torch.Tensor:
    """An fp32 activation (wide under bf16 compute); ``.to(BF16)`` for a stream tensor."""
    return torch.randn(2, 4, 16)


def s16() -> torch.Tensor:
    return x16().to(BF16)


def test_llama_rmsnorm_gives_one_weight_promotion_source_per_norm() -> None:
    report = bf16_lint(lm.NormMLP(), s16())
    promos = report.by_kind("weight-promotion")
    assert sorted(f.module for f in promos) == ["norm1", "norm2"]
    assert all(f.severity == "error" and f.code == "FXP002" for f in promos)
    assert "self.weight * h.to(input_dtype)" in (promos[0].source_line or "")
    assert kinds(report) == ["weight-promotion", "weight-promotion"]


def test_weight_promotion_quiet_when_norm_weights_gather_at_bf16() -> None:
    model = lm.NormMLP()
    plan = fxp.compile_precision(model, fxp.parse_precision_rules("cls:LlamaRMSNorm=bf16"), default_gather="fp32")
    report = bf16_lint(model, s16(), plan=plan)
    assert report.stream_counts().get("fp32", 0) == 0
    assert len(report.graphs[0].gather_casts) == 2
    # what is left: the root's linears only feed autocast-covered ops, so the root could gather at bf16 too
    (hint,) = report.findings
    assert (hint.kind, hint.severity, hint.unit) == ("wide-gather", "info", "")


def test_softmax_in_fp32_and_back_is_no_finding() -> None:
    assert bf16_lint(lm.SoftmaxFp32(), s16()).findings == []


def test_intended_fp32_residual_is_an_explicit_upcast_warning_never_an_error() -> None:
    report = bf16_lint(lm.Fp32Residual(), x16().to(BF16))
    (finding,) = report.findings
    assert (finding.kind, finding.code, finding.severity) == ("explicit-upcast", "FXP101", "warn")
    assert "x.float() + self.block(x)" in (finding.source_line or "")
    assert report.worst_severity == "warn"


def test_wide_input_fires_on_a_wide_graph_input_and_not_on_a_narrow_one() -> None:
    wide = bf16_lint(lm.ResidualOnWideInput(), x16())
    (finding,) = wide.findings
    assert (finding.kind, finding.code, finding.severity) == ("wide-input", "FXP102", "warn")
    assert "cast_forward_inputs" in finding.message
    assert bf16_lint(lm.ResidualOnWideInput(), x16().to(BF16)).findings == []


def test_round_trip_cast_fires_only_with_nothing_between() -> None:
    report = bf16_lint(lm.RoundTrip(), x16().to(BF16))
    (finding,) = report.findings
    assert (finding.kind, finding.code, finding.severity) == ("round-trip-cast", "FXP201", "info")
    assert bf16_lint(lm.RoundTrip(between=True), x16().to(BF16)).by_kind("round-trip-cast") == []


def test_plan_mismatch_fires_when_the_graph_sees_an_unplanned_dtype() -> None:
    model = lm.NormMLP()
    plan = fxp.compile_precision(model, fxp.PrecisionSpec(), default_gather="fp32")
    assert bf16_lint(model, s16(), plan=plan).by_kind("plan-mismatch") == []
    model.mid.to(torch.float16)  # neither the planned gather (fp32) nor master (fp32)
    (mismatch,) = bf16_lint(model, s16(), plan=plan).by_kind("plan-mismatch")  # one cause, said once
    assert mismatch.code == "FXP202" and "mid.weight" in mismatch.message and "mid.bias" in mismatch.message
    assert mismatch.message.startswith("2 parameters (") and "are seen at fp16" in mismatch.message
    model.mid.bias.data = model.mid.bias.data.float()  # now one parameter alone: named on its own
    (single,) = bf16_lint(model, s16(), plan=plan).by_kind("plan-mismatch")
    assert "parameter mid.weight is seen at fp16, the plan gathers it at fp32" in single.message


def test_wide_gather_suggests_the_rule_for_a_unit_whose_weights_only_feed_covered_ops() -> None:
    model = lm.EmbedMLP()
    ids = torch.randint(0, 32, (2, 4))
    plan = fxp.compile_precision(model, fxp.PrecisionSpec(), default_gather="fp32", wrap=["mlp"])
    report = bf16_lint(model, ids, plan=plan)
    (finding,) = report.by_kind("wide-gather")
    assert (finding.code, finding.unit, finding.suggestion) == ("FXP203", "mlp", "mlp=bf16")
    fixed = fxp.compile_precision(model, fxp.parse_precision_rules("mlp=bf16"), default_gather="fp32", wrap=["mlp"])
    assert bf16_lint(model, ids, plan=fixed).by_kind("wide-gather") == []


def test_graph_breaks_give_one_report_per_graph() -> None:
    report = bf16_lint(lm.WithGraphBreak(), torch.randint(0, 32, (2, 4)))
    assert len(report.graphs) == 2
    assert [f.kind for f in report.graphs[0].findings] == ["uncovered-op"]
    assert [f.kind for f in report.graphs[1].findings] == ["wide-input"]  # the fp32 stream arrives in graph 1


def test_no_autocast_means_no_wide_dtype_findings() -> None:
    report = lint(lm.NormMLP(), x16())
    assert report.compute is None and report.findings == []


def test_dynamic_wide_bytes_are_a_sympy_expression_that_matches_the_static_figure() -> None:
    model = fxp_toy()
    ids = torch.randint(0, 128, (2, 8))
    dyn = bf16_lint(model, ids, dynamic=True).graphs[0].census
    static = bf16_lint(model, ids).graphs[0].census
    expr = dyn.wide_stream_bytes
    assert {str(s) for s in expr.free_symbols} == {"input_ids_size0", "input_ids_size1"}
    assert dyn.size_hints == {"input_ids_size0": 2, "input_ids_size1": 8}
    b, s = sympy.symbols("input_ids_size0 input_ids_size1", integer=True, positive=True)
    assert int(expr.subs({b: 2, s: 8})) == int(static.wide_stream_bytes) > 0
    assert static.wide_stream_bytes.is_number


def fxp_toy() -> torch.nn.Module:
    from fx_precision.tools.toy_decoder import ToyDecoder

    torch.manual_seed(0)
    return ToyDecoder()


def test_fake_tensor_model_lints_like_the_real_one() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = bf16_lint(fxp_toy(), torch.randint(0, 128, (2, 8)))
    with FakeTensorMode():
        fake_model = fxp_toy()
        ids = torch.randint(0, 128, (2, 8))
    fake = bf16_lint(fake_model, ids)
    assert [(f.code, f.module, f.propagations) for f in fake.findings] == [(f.code, f.module, f.propagations) for f in real.findings]
    assert fake.graphs[0].census.to_dict() == real.graphs[0].census.to_dict()


def qwen(device: str | None = None) -> torch.nn.Module:
    from fx_precision.tools.zoo import build_model

    return build_model("qwen3_5-tiny", device=device)


def qwen_ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.needs_transformers
def test_qwen3_5_as_is_has_exactly_one_uncovered_op_source_with_a_chain_to_a_late_layer() -> None:
    report = bf16_lint(qwen(), qwen_ids(), use_cache=False)
    (source,) = [f for f in report.findings if f.kind in ("uncovered-op", "weight-promotion")]
    assert (source.kind, source.module, source.severity) == ("uncovered-op", "model.embed_tokens", "error")
    assert "embedding" in source.message and "embed_tokens(input_ids)" in (source.source_line or "")
    assert source.propagations > 50 and source.stream_tensors == report.stream_counts()["fp32"]
    assert any(link.startswith("model.layers.3") for link in source.chain)
    assert source.chain[-1].startswith("model.embed_tokens: embedding")
    assert report.findings == [source]  # propagations are counted under it, not listed


@pytest.mark.needs_transformers
def test_qwen3_5_with_embedding_gathered_at_bf16_has_no_source_and_no_fp32_stream() -> None:
    model = qwen()
    plan = fxp.compile_precision(model, fxp.parse_precision_rules("*embed_tokens=bf16"), default_gather="fp32")
    report = bf16_lint(model, qwen_ids(), use_cache=False, plan=plan)
    assert report.findings == []
    assert report.stream_counts().get("fp32", 0) == 0 and report.stream_counts()["bf16"] > 0


@pytest.mark.needs_transformers
def test_meta_lint_agrees_with_real_tensor_lint() -> None:
    real = bf16_lint(qwen(), qwen_ids(), use_cache=False)
    meta = bf16_lint(qwen("meta"), qwen_ids(), use_cache=False)
    assert [f.to_dict() for f in meta.findings] == [f.to_dict() for f in real.findings]
    assert meta.graphs[0].census.to_dict() == real.graphs[0].census.to_dict()


@pytest.mark.needs_transformers
def test_full_size_qwen3_5_4b_lints_on_meta_without_allocating_weights() -> None:
    # in a fresh interpreter, so the peak RSS is this lint's alone (not whatever ran before in pytest)
    code = (
        "import resource, torch\n"
        "from fx_precision import lint\n"
        "from fx_precision.tools.zoo import build_model\n"
        "model = build_model('qwen3_5-4b', device='meta')\n"
        "n = sum(p.numel() for p in model.parameters())\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    report = lint(model, torch.randint(0, 1000, (1, 32)), use_cache=False)\n"
        "(source,) = report.findings\n"
        "assert all(p.device.type == 'meta' for p in model.parameters())\n"
        "print(n, source.kind, source.module, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    n_params, kind, module, max_rss_kib = out.stdout.split()
    assert int(n_params) > 4e9 and (kind, module) == ("uncovered-op", "model.embed_tokens")
    weights_gib = int(n_params) * 4 / 2**30  # what materialised fp32 weights would take: 18 GiB
    assert int(max_rss_kib) / 2**20 < weights_gib / 8, f"peak RSS {int(max_rss_kib) / 2**20:.1f} GiB: weights were materialised"


def validate_lint_json(data: dict) -> None:
    """The shape documented in the README ("lint JSON")."""
    assert data["version"] == 1 and data["worst_severity"] in (None, "info", "warn", "error")
    assert isinstance(data["compute"], (str, type(None))) and isinstance(data["device_type"], str)
    for graph in data["graphs"]:
        assert isinstance(graph["index"], int)
        census = graph["census"]
        assert set(census) == {"float_nodes", "stream", "wide_stream_bytes", "wide_stream_bytes_at_example_sizes", "size_hints"}
        for finding in graph["findings"]:
            assert {"code", "severity", "kind", "module", "unit", "node", "source_line", "chain", "message"} <= set(finding)
            assert finding["severity"] in ("info", "warn", "error") and finding["code"].startswith("FXP")
            assert isinstance(finding["chain"], list)


@pytest.mark.needs_transformers
def test_cli_lint_exit_status_json_and_dot(tmp_path: object) -> None:
    as_is = run_cli("lint", "--model", "qwen3_5-tiny", "--fail-on", "error", "--json")
    assert as_is.returncode == 1, as_is.stderr
    validate_lint_json(json.loads(as_is.stdout))
    fixed_dot, dot_file = f"{tmp_path}/fixed.dot", f"{tmp_path}/flow.dot"
    fixed = run_cli("lint", "--model", "qwen3_5-tiny", "--fail-on", "error", "--rules", "*embed_tokens=bf16", "--dot", fixed_dot)
    assert fixed.returncode == 0, fixed.stderr
    fixed_text = open(fixed_dot).read()
    assert fixed_text.startswith("digraph") and "SOURCE" not in fixed_text and "#f4a6a6" not in fixed_text  # no fp32 module
    as_is_dot = run_cli("lint", "--model", "qwen3_5-tiny", "--dot", dot_file)
    text = open(dot_file).read()
    assert as_is_dot.returncode == 1 and text.startswith("digraph") and "SOURCE FXP001" in text
    if shutil.which("dot"):  # Debian's graphviz (.ci/run installs it when apt is reachable)
        svg = subprocess.run(["dot", "-Tsvg", dot_file], capture_output=True, text=True, timeout=60)
        assert svg.returncode == 0 and "<svg" in svg.stdout, svg.stderr


@pytest.mark.needs_transformers
def test_llama_lint_lists_the_embedding_and_the_norms_it_masks_in_one_run() -> None:
    """LlamaForCausalLM, 3 layers: the embedding as traced, then 2 norms per layer and the final norm,
    each masked by the embedding; no RoPE or KV-cache artefacts."""
    from fx_precision.tools.arch_zoo import Arch

    model = Arch("llama", "LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 3}).build()
    report = bf16_lint(model, input_ids=torch.randint(0, 256, (1, 8)))
    embed, *norms = sorted((f for f in report.findings if f.is_source), key=lambda f: f.round)
    assert (embed.kind, embed.module, embed.round) == ("uncovered-op", "model.embed_tokens", 0)
    assert len(norms) == 7 and all(f.kind == "weight-promotion" and f.round == 1 for f in norms)
    assert all(f.masked_by == (embed.node,) for f in norms)
    assert {f.module.rsplit(".", 1)[-1] for f in norms} == {"input_layernorm", "post_attention_layernorm", "norm"}
    assert len(report.findings) == 8  # nothing else: the artefacts of the leak are not listed


def test_lint_leaves_the_users_compiled_functions_compiled() -> None:
    """fxp.lint traces with a backend of its own; a function the user compiled before keeps its compiled code (its
    backend is not called again on its next call), and linting twice gives the same findings."""
    import torch
    from torch import nn

    import fx_precision as fxp

    compiles: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiles.append(1)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16))
    users = torch.compile(lambda x: model(x) * 2, backend=counting)
    ids = torch.randint(0, 32, (2, 5))
    users(ids)
    assert len(compiles) == 1
    with torch.autocast("cpu", torch.bfloat16):
        first = fxp.lint(model, ids)
        again = fxp.lint(model, ids)
    users(ids)
    assert len(compiles) == 1, "the user's function was compiled again"
    assert first.findings and [f.code for f in first.findings] == [f.code for f in again.findings]


@pytest.mark.needs_transformers
def test_a_failure_inside_transformers_model_code_is_one_line_naming_the_architecture_release_and_line() -> None:
    """What a transformers release that moved model code looks like to the analysis: an exception raised inside the model's
    own code while Dynamo captures it (here an attention mask of the wrong length). One PrecisionError line naming the
    architecture, the transformers release, the file and line of the model code and what it raised, not a traceback."""
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))  # fmt: skip
    with pytest.raises(PrecisionError) as raised, torch.autocast("cpu", dtype=torch.bfloat16):
        fxp.lint(model, torch.randint(0, 64, (1, 5)), attention_mask=torch.ones(1, 7), use_cache=False)
    text = str(raised.value)
    assert "\n" not in text
    assert f"Qwen3ForCausalLM (transformers {transformers.__version__})" in text
    assert re.search(r"at transformers/[\w/]+\.py:\d+ \(RuntimeError: ", text), text
