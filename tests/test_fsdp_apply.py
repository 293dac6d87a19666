"""FSDP2 application on real gloo ranks: dtypes seen in forward, fp32 master/grads, 1-vs-2-rank parity, DCP."""

from __future__ import annotations

import pytest
import torch

from fx_precision import PrecisionError, compile_precision, parse_precision_rules
from fx_precision.fsdp import apply_fsdp2, layer_wrap_globs
from fx_precision.ranks import run_on_ranks
from fx_precision.tools.zoo import build_model
from tests import fsdp_workers
from tests.model_state import model_snapshot, same_model_state

# Tolerances for 2-rank vs 1-rank (fp32 compute). Parameters gathered at fp32 differ only by the
# order of the fp32 gradient reduction: 1e-5. A bf16-gathered weight's gradient is formed at bf16 per
# rank (over half the batch) before the fp32 reduce-scatter, so the two runs round at different
# points: bf16 has 8 mantissa bits, hence 2e-2 relative on that weight.
FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}


def _tol(gather: torch.dtype) -> dict[str, float]:
    return FP32_TOL if gather == torch.float32 else BF16_TOL


def _check_seen_matches_plan(result: dict) -> None:
    """Every module's pre-hook saw each parameter of its subtree at the plan's gather dtype."""
    plan_gather = result["plan_gather"]
    checked = set()
    for module_fqn, params in result["seen"].items():
        if module_fqn == "":
            continue  # the root pre-hook runs before the inner units gather: it sees their shards
        for name, dtype in params.items():
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            owners = result["unit_of"][fqn]
            if not any(unit == "" or unit == module_fqn or module_fqn.startswith(unit + ".") for unit in owners):
                continue  # an inner unit's parameters, seen before that unit's own pre-forward gather
            assert dtype == plan_gather[fqn], f"{fqn} seen by {module_fqn} at {dtype}, plan says {plan_gather[fqn]}"
            checked.add(fqn)
    assert checked == set(plan_gather)


def _check_master_and_grads_fp32(result: dict) -> None:
    for fqn, (param_dtype, grad_dtype, kind) in result["sharded"].items():
        assert kind == "DTensor", fqn
        assert param_dtype == torch.float32 and grad_dtype == torch.float32, (fqn, param_dtype, grad_dtype)


@pytest.mark.parametrize("model_name", ["toy-decoder", pytest.param("qwen3_5-tiny", marks=pytest.mark.needs_transformers)])
def test_two_ranks_match_one_rank_and_plan(model_name: str, tmp_path: object) -> None:
    rules = "*embed_tokens=bf16"
    (two,) = [r for r in run_on_ranks(fsdp_workers.train_step, 2, model_name, rules, None, str(tmp_path)) if r]
    (one,) = [r for r in run_on_ranks(fsdp_workers.train_step, 1, model_name, rules, None, None) if r]

    _check_seen_matches_plan(two)
    assert two["seen"]["model.embed_tokens"]["weight"] == torch.bfloat16
    assert all(dtype == torch.float32 for name, dtype in two["seen"]["model.layers.0.mlp.up_proj"].items())
    _check_master_and_grads_fp32(two)

    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for fqn, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][fqn], grad, **_tol(two["plan_gather"][fqn]), msg=f"grad {fqn}")
        torch.testing.assert_close(two["params"][fqn], one["params"][fqn], **_tol(two["plan_gather"][fqn]), msg=f"param {fqn}")

    # DCP: what the wrapped model saved loads back into a freshly wrapped (differently seeded) one
    assert two["restored"] is not None
    for fqn, value in two["params"].items():
        assert torch.equal(two["restored"][fqn], value), fqn


@pytest.mark.needs_transformers
@pytest.mark.parametrize("model_name", ["qwen3_5-tiny", "qwen3_5-tiny-tied"])
def test_qwen3_5_bf16_autocast_resolved_policy_gathers_embedding_at_bf16(model_name: str, tmp_path: object) -> None:
    """Untied and tied (embedding = lm_head: one group unit, ``fully_shard([embed_tokens, lm_head])``)."""
    (result,) = [r for r in run_on_ranks(fsdp_workers.train_step, 2, model_name, "", "bf16", str(tmp_path)) if r]
    assert result["cast_forward_inputs"] is False
    _check_seen_matches_plan(result)
    assert result["seen"]["model.embed_tokens"]["weight"] == torch.bfloat16
    if model_name.endswith("tied"):
        assert result["seen"]["lm_head"]["weight"] == torch.bfloat16  # one object: gathered once, for both uses
        assert result["unit_of"]["lm_head.weight"] == ("model.embed_tokens", "lm_head")
    for fqn, value in result["params"].items():  # one SGD step ran; DCP restores exactly what it saved
        assert torch.equal(result["restored"][fqn], value), fqn
    assert result["seen"]["model.layers.1.self_attn.q_proj"]["weight"] == torch.float32
    _check_master_and_grads_fp32(result)
    assert all(not mp.cast_forward_inputs for _, mp in result["units"])


@pytest.mark.needs_transformers
def test_default_policy_wraps_like_plain_per_layer_fsdp2() -> None:
    (result,) = [r for r in run_on_ranks(fsdp_workers.default_vs_plain_wrap, 2, "qwen3_5-tiny") if r]
    assert result["rules"] == 0 and result["cast_forward_inputs"] is True
    assert result["ours"] == result["plain"]
    assert [fqn for fqn, _ in result["ours"]] == ["", *(f"model.layers.{i}" for i in range(4))]


@pytest.mark.parametrize(
    ("rules", "tie", "message"),
    [
        ("*embed_tokenz=bf16", False, "selects no module"),
        ("model.embed_tokens=bf16; lm_head=fp32", True, "tied parameter"),  # two explicit rules on one object
    ],
)
def test_bad_rules_raise_in_compile_precision(rules: str, tie: bool, message: str) -> None:
    model = build_model("toy-decoder")
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(PrecisionError, match=message):
        compile_precision(model, parse_precision_rules(rules), default_gather="fp32", wrap=layer_wrap_globs(model))


@pytest.mark.parametrize("defect", ["duplicate unit", "no root unit", "gather off its unit"])
def test_apply_rejects_an_inconsistent_plan_before_changing_anything(defect: str) -> None:
    """apply_fsdp2 itself refuses: the plan compiles, is then broken, and the bf16 model (which the
    fp32-master plan would convert) stays bit for bit as it was."""
    from dataclasses import replace

    model = build_model("toy-decoder").to(torch.bfloat16)
    plan = compile_precision(
        model, parse_precision_rules("*embed_tokens=bf16"), default_gather="fp32", default_master="fp32", wrap=layer_wrap_globs(model)
    )
    if defect == "duplicate unit":
        broken = replace(plan, units=(plan.units[0], *plan.units))
    elif defect == "no root unit":
        broken = replace(plan, units=plan.units[:-1])
    else:
        embed = plan.params["model.embed_tokens.weight"]
        broken = replace(plan, params={**plan.params, embed.fqn: replace(embed, gather=torch.float32)})
    before = model_snapshot(model)
    with pytest.raises(PrecisionError, match=r"appears twice|exactly one root unit|gathers at fp32 but its unit"):
        apply_fsdp2(model, broken, mesh=None)
    assert same_model_state(before, model_snapshot(model))


def test_apply_rejects_a_plan_for_another_model_without_touching_it() -> None:
    model = build_model("toy-decoder")
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    plan = compile_precision(other, parse_precision_rules(""), default_gather="fp32")
    before = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(PrecisionError, match="does not match this model"):
        apply_fsdp2(model, plan, mesh=None)
    assert {n: p.dtype for n, p in model.named_parameters()} == before
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_hsdp_on_a_2x2_mesh_gathers_as_planned_and_matches_the_1d_run() -> None:
    """4 gloo ranks as 2 replicas x 2 shards: per-module gather dtypes as planned, fp32 masters and
    gradients, and the gradients of the 1-D run over the same 4 ranks and data."""
    rules = "*embed_tokens=bf16"
    runs = [("train_step", ("toy-decoder", rules, None, None, (2, 2))), ("train_step", ("toy-decoder", rules, None, None))]
    ((hsdp, flat),) = [r for r in run_on_ranks(fsdp_workers.in_turn, 4, runs) if r]
    _check_seen_matches_plan(hsdp)
    assert hsdp["seen"]["model.embed_tokens"]["weight"] == torch.bfloat16
    _check_master_and_grads_fp32(hsdp)
    assert hsdp["loss"] == pytest.approx(flat["loss"], rel=1e-6)
    for fqn, grad in flat["grads"].items():
        torch.testing.assert_close(hsdp["grads"][fqn], grad, **_tol(hsdp["plan_gather"][fqn]), msg=f"grad {fqn}")
