"""The fixed point: sources a propagation hides until its upstream is fixed, in lint and backend."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fx_precision as fxp
from tests import lint_models as lm

BF16 = torch.bfloat16


def hand_fixed(model: lm.EmbedLlamaNorm) -> nn.Module:
    """The fix a user writes by hand: cast the embedding's and the norm's outputs to bf16."""
    fixed = copy.deepcopy(model)
    for module in (fixed.embed, fixed.norm):
        module.register_forward_hook(lambda _m, _a, out: out.to(BF16))
    return fixed


def test_lint_lists_the_masked_norm_with_what_masked_it() -> None:
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=BF16):
        report = fxp.lint(lm.EmbedLlamaNorm(), torch.randint(0, 32, (2, 4)))
    embed, norm = sorted(report.findings, key=lambda f: f.round)
    assert (embed.kind, embed.module, embed.round, embed.masked_by) == ("uncovered-op", "embed", 0, ())
    assert (norm.kind, norm.module, norm.round) == ("weight-promotion", "norm", 1)
    assert norm.masked_by == (embed.node,) and norm.masked
    assert "self.weight * h.to(input_dtype)" in (norm.source_line or "")
    assert report.graphs[0].rounds == 2
    data = report.to_dict()["graphs"][0]
    assert data["rounds"] == 2 and [f["masked_by"] for f in data["findings"]] == [[], [embed.node]]
    assert "masked (round 1)" in report.render()


def test_lint_on_a_fixed_model_has_no_masked_findings() -> None:
    model = lm.EmbedLlamaNorm()
    plan = fxp.compile_precision(model, fxp.parse_precision_rules("embed=bf16; norm=bf16"), default_gather="fp32")
    with torch.autocast("cpu", dtype=BF16):
        report = fxp.lint(model, torch.randint(0, 32, (2, 4)), plan=plan)
    assert [f for f in report.findings if f.is_source] == [] and report.graphs[0].rounds == 0


def test_backend_fixes_both_rounds_in_one_compile_and_matches_the_hand_fix() -> None:
    torch.manual_seed(0)
    model = lm.EmbedLlamaNorm()
    ids = torch.randint(0, 32, (2, 4))
    with torch.autocast("cpu", dtype=BF16):
        want = hand_fixed(model)(ids)
        backend = fxp.make_precision_backend(inner="aot_eager")
        got = torch.compile(model, backend=backend)(ids)
    assert torch.equal(got, want)
    (report,) = backend.reports
    assert report.rounds == 2 and report.after == []
    assert [(f.module, f.round) for f in report.before if f.is_source] == [("embed", 0), ("norm", 1)]
    assert [c.module for c in report.source_casts] == ["embed", "norm"]
    assert report.stream_after.get("fp32", 0) == 0 and report.stream_before["fp32"] > 0
    got.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_a_cast_that_follows_a_weight_into_a_custom_op_follows_the_weight_read_the_pass_casts() -> None:
    """``op(x.to(w.dtype), w)`` with a custom op that needs one dtype (transformers' MoE experts: grouped_mm): once the
    embedding is fixed, ``x`` is bf16 and the cast an upcast into an op autocast does not cover: the op's source
    (FXP001, masked by the embedding). The pass casts the weight read for that op and the cast follows it: the op
    runs at bf16, never at the bf16 x fp32 mix it cannot run."""

    @torch.library.custom_op("fxp_test::weighted", mutates_args=())
    def weighted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w)  # needs one dtype: fails on bf16 x fp32

    @weighted.register_fake
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], w.shape[1])

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids).flatten(0, 1)
            return h + weighted(h.to(self.w.dtype), self.w).to(h.dtype)

    graphs: list[torch.fx.GraphModule] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        graphs.append(gm)
        return gm.forward

    backend = fxp.make_precision_backend(inner=inner)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=BF16), torch.no_grad():  # the op has no autograd formula; forward is the point
        out = torch.compile(Experts(), backend=backend)(torch.randint(0, 32, (2, 4)))
    assert out.dtype == BF16
    (report,) = backend.reports
    source = [f for f in report.before if f.code == "FXP001" and f.module == ""]
    assert len(source) == 1 and source[0].round == 1 and "weighted.default is not autocast-covered and needs one dtype" in source[0].message
    assert [c.kind for c in report.casts if c.fixes == source[0].node] == ["weight-read"]
    followed = [c for c in report.retargeted if c.reason.startswith("weight-following")]
    assert [c.node for c in followed] == [source[0].node]
    (op,) = [n for n in graphs[0].graph.nodes if "weighted" in str(n.target)]
    assert [a.meta["example_value"].dtype for a in op.all_input_nodes] == [BF16, BF16]
    torch._dynamo.reset()


@pytest.mark.parametrize("literal", [True, False])
def test_a_literal_cast_and_a_following_cast_on_one_line_are_told_apart(literal: bool) -> None:
    """``F.layer_norm(h.to(dtype=torch.float32), ...).to(orig)``: only the second follows the stream."""

    class Norm(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if literal:
                return nn.functional.layer_norm(h.to(dtype=torch.float32), h.shape[-1:]).to(torch.float32)
            orig = h.dtype
            return nn.functional.layer_norm(h.to(dtype=torch.float32), h.shape[-1:]).to(orig)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.norm = Norm()
            self.head = nn.Linear(16, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            return self.head(self.norm(h) + h)  # the residual add is not autocast-covered: the norm's dtype shows

    backend = fxp.make_precision_backend(inner="aot_eager")
    with torch.autocast("cpu", dtype=BF16):
        torch.compile(Net(), backend=backend)(torch.randint(0, 32, (2, 4)))
    (report,) = backend.reports
    if literal:  # the program asked for an fp32 norm output: kept, reported, never narrowed
        assert report.retargeted == [] and [f.kind for f in report.after] == ["explicit-upcast"]
    else:
        assert [r.reason.split(" (")[0] for r in report.retargeted] == ["dtype-following cast retargeted fp32 -> bf16"]
        assert report.after == [] and report.stream_after.get("fp32", 0) == 0


def test_a_promotion_by_a_module_crossing_operand_casts_that_operand_like_a_hand_fix() -> None:
    """``wte(ids) + wpe(positions)``: once wte is cast, the add promotes with wpe's fp32 output,
    which crosses from module wpe; the pass casts that operand, as a hand fix casts wpe's output."""
    torch.manual_seed(0)
    model = lm.AbsolutePositions()
    ids = torch.randint(0, 32, (2, 8))
    fixed = copy.deepcopy(model)
    for module in (fixed.wte, fixed.wpe):
        module.register_forward_hook(lambda _m, _a, out: out.to(BF16))
    with torch.autocast("cpu", dtype=BF16):
        want = fixed(ids)
        backend = fxp.make_precision_backend(inner="aot_eager")
        got = torch.compile(model, backend=backend)(ids)
    assert torch.equal(got, want)
    (report,) = backend.reports
    operand = [c for c in report.casts if c.kind == "source-operand"]
    assert [(c.module, c.frm, c.to) for c in operand] == [("wpe", torch.float32, BF16)]
    assert report.after == [] and report.stream_after.get("fp32", 0) == 0
    assert [(f.module, f.round) for f in report.before if f.is_source] == [("wte", 0), ("", 1)]


def test_a_mask_built_at_the_streams_traced_dtype_follows_it_with_its_finfo_fill() -> None:
    """The mask is traced as fp32 with finfo(fp32).min while the embedding leaks; the pass rebuilds it
    at bf16 with finfo(bf16).min, as the program does once the embedding is fixed (a cast would
    turn finfo(fp32).min into -inf)."""
    torch.manual_seed(0)
    model = lm.MaskFromStream()
    ids = torch.randint(0, 32, (2, 8))
    fixed = copy.deepcopy(model)
    fixed.embed.register_forward_hook(lambda _m, _a, out: out.to(BF16))
    with torch.autocast("cpu", dtype=BF16):
        want = fixed(ids)
        backend = fxp.make_precision_backend(inner="aot_eager")
        got = torch.compile(model, backend=backend)(ids)
    assert torch.equal(got, want) and torch.isfinite(got).all()
    (report,) = backend.reports
    constants = [c for c in report.retargeted if "constant" in c.reason]
    assert [(c.frm, c.to) for c in constants] == [(torch.float32, BF16)]
    assert report.stream_after.get("fp32", 0) == 0
