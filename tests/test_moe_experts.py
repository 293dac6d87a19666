"""MoE experts at the compute dtype: transformers runs stacked experts through ``grouped_mm`` after
``input.to(weight.dtype)``, which autocast does not cover. Under an fp32 gather they compute at fp32
unless the policy gathers them narrow (``archs/moe_experts.py``) or the backend casts their weight reads.

Held-out sizes here on purpose (expert counts, widths and top-k no other test uses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fx_precision as fxp
from fx_precision.archs.moe_experts import experts_at_compute_dtype, holds_stacked_experts
from fx_precision.policy import PrecisionPolicy, resolve_policy
from fx_precision.spec import ModuleSel, Rule
from tests.cli import run_cli

pytestmark = pytest.mark.needs_transformers

MOE_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=40),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=3, num_experts_per_tok=2, intermediate_size=56)),
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
}
DIMS = dict(vocab_size=200, hidden_size=40, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=10, max_position_embeddings=64)  # fmt: skip


def build(name: str, **overrides: Any) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, moe = MOE_CONFIGS[name]
    kwargs = {**DIMS, **moe, **overrides}
    if name == "deepseek-v3":
        kwargs.pop("head_dim")
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).float().eval()


def expert_fqns(model: torch.nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_resolve_policy_gathers_every_stacked_expert_module_at_compute_and_nothing_else(name: str) -> None:
    model = build(name)
    policy = resolve_policy(model, gather="fp32", compute="bf16")
    experts = expert_fqns(model)
    assert experts  # the family has routed experts
    assert [r for r in policy.spec.rules if r.select.fqn in experts] == [Rule(ModuleSel(fqn=fqn), gather=torch.bfloat16) for fqn in experts]
    assert all(holds_stacked_experts(model.get_submodule(fqn)) for fqn in experts)
    others = [fqn for fqn, m in model.named_modules() if fqn not in experts and holds_stacked_experts(m)]
    assert others == []  # shared experts (nn.Linear), routers, norms, convolutions hold no stacked weights
    assert len(resolve_policy(model, gather="fp32", compute=None).spec) == 0  # self-activating: no autocast
    assert len(resolve_policy(model, gather="bf16", compute="bf16").spec) == 0  # gather is compute already


def test_no_rule_where_bf16_grouped_mm_cannot_run_the_expert_sizes() -> None:
    """grouped_mm needs 16-byte rows: an intermediate size of 12 is 24 bytes at bf16. The rule would break an
    eager forward that runs at fp32; the backend still narrows the weight reads under torch.compile."""
    model = build("qwen3-moe", moe_intermediate_size=12)
    assert len(experts_at_compute_dtype(model.config, PrecisionPolicy(compute="bf16"), model)) == 0
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):  # what the rule would have caused
        torch.nn.functional.grouped_mm(
            torch.ones(4, 12, dtype=torch.bfloat16),
            torch.ones(2, 12, 40, dtype=torch.bfloat16),
            offs=torch.tensor([2, 4], dtype=torch.int32),
        )


def test_from_a_config_alone_the_rule_selects_the_experts_by_name() -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(**{**DIMS, **MOE_CONFIGS["qwen3-moe"][2]})
    assert resolve_policy(config, gather="fp32", compute="bf16").spec.rules == (Rule(ModuleSel(fqn="*.experts"), gather=torch.bfloat16),)
    dense = transformers.Qwen3Config(**DIMS)
    assert len(resolve_policy(dense, gather="fp32", compute="bf16").spec) == 0


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_lint_names_the_experts_read_as_the_uncovered_op_class_with_its_fix(name: str) -> None:
    model = build(name)
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(3))
    report = fxp.lint(model, ids, policy=PrecisionPolicy(gather="fp32", compute="bf16"))
    at_experts = [f for f in report.findings if f.module in expert_fqns(model)]
    assert at_experts and all(f.code == "FXP001" and f.kind == "uncovered-op" for f in at_experts), [f.explain() for f in at_experts]
    projections = {f.message.split(" reads ", 1)[1].split(" at ", 1)[0].rsplit(".", 1)[-1] for f in at_experts}
    assert projections == {"gate_up_proj", "down_proj"}  # both GEMMs, the second contained or not
    assert all("grouped_mm" in f.message and "rule '*experts=bf16'" in (f.suggestion or "") for f in at_experts)
    # under the resolved policy (experts gathered at bf16, emulated on one device) nothing is left at the experts
    policy = resolve_policy(model, gather="fp32", compute="bf16")
    planned = fxp.lint(model, ids, policy=policy, plan=policy.plan(model))
    assert [f.explain() for f in planned.findings if f.module in expert_fqns(model)] == []


def _grouped_mm_dtypes(backend_graphs: list[torch.fx.GraphModule]) -> list[tuple[torch.dtype, ...]]:
    out = []
    for gm in backend_graphs:
        for node in gm.graph.nodes:
            if "grouped_mm" in str(node.target):
                out.append(
                    tuple(a.meta["example_value"].dtype for a in node.all_input_nodes if a.meta["example_value"].is_floating_point())
                )
    return out


@pytest.mark.parametrize("with_rules", [False, True], ids=["backend-casts-the-reads", "planned-gather"])
def test_the_backend_runs_every_expert_gemm_at_bf16_and_the_grads_stay_fp32(with_rules: bool) -> None:
    model = build("qwen2-moe")
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(4))
    policy = resolve_policy(model, gather="fp32", compute="bf16") if with_rules else PrecisionPolicy(gather="fp32", compute="bf16")
    graphs: list[torch.fx.GraphModule] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    backend = fxp.make_precision_backend(policy=policy, plan=policy.plan(model) if with_rules else None, inner=inner)
    torch._dynamo.reset()
    with policy.forward_context("cpu"):
        logits = torch.compile(model, backend=backend)(ids).logits
    logits.float().square().mean().backward()
    torch._dynamo.reset()
    gemms = _grouped_mm_dtypes(graphs)
    assert len(gemms) == 2 * 2 and all(set(d) == {torch.bfloat16} for d in gemms), gemms  # 2 layers x (gate_up, down)
    assert torch.isfinite(logits).all()
    expert_grads = {n: p.grad.dtype for n, p in model.named_parameters() if ".experts." in n}
    assert expert_grads and set(expert_grads.values()) == {torch.float32}
    assert not [f for r in backend.reports for f in r.after if f.severity == "error"]


def test_the_eager_fix_names_the_gathers_no_hook_can_make() -> None:
    model = build("qwen3-moe")
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(5))
    fix = fxp.eager_casts(model, ids, policy=PrecisionPolicy(compute="bf16"))
    assert [r.select.fqn for r in fix.gathers.rules] == expert_fqns(model)
    assert {c.kind for c, _ in fix.compile_only} >= {"weight-read"}
    assert "gathers (apply reads these modules' weights" in fix.render()
    assert json.loads(json.dumps(fix.to_dict()))["gathers"] == [f"{fqn}=gather:bf16" for fqn in expert_fqns(model)]


def test_census_under_fsdp2_with_arch_rules_leaves_no_fp32_in_the_experts(tmp_path: Path) -> None:
    """Real FSDP2 on 2 gloo ranks, eager, transformers' own grouped_mm: a held-out Qwen3-MoE size."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{**DIMS, **MOE_CONFIGS["qwen3-moe"][2]})
    config.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "census.json"
    args = ["census", "--model", str(tmp_path / "ckpt"), "--gather", "fp32", "--compute", "bf16", "--world-size", "2"]
    done = run_cli(*args, "--arch-rules", "--backward", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    act = {m["module"]: m for m in json.loads(out.read_text())["modules"] if m["module"].endswith(".experts.act_fn")}
    assert act and all(set(row["in"]) == set(row["out"]) == {"bf16"} for row in act.values()), act  # the GEMMs' output: bf16
    # with the eager fix too (the norms' weight promotion feeds the experts fp32 otherwise): nothing fp32 in or around them
    done = run_cli(*args, "--arch-rules", "--eager-fix", "--backward", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    modules = json.loads(out.read_text())["modules"]
    experts = {m["module"]: m for m in modules if ".experts" in m["module"]}
    assert experts, [m["module"] for m in modules]
    for name, row in experts.items():
        float_io = {k: v for side in ("in", "out", "grad") for k, v in row[side].items() if k in ("fp32", "bf16")}
        assert float_io and set(float_io) == {"bf16"}, (name, row)
    done = run_cli(*args, "--json", str(out))  # without the rules: the experts compute at fp32 (what the rule is for)
    assert done.returncode == 0, done.stderr[-2000:]
    asis = {m["module"]: m for m in json.loads(out.read_text())["modules"] if m["module"].endswith(".experts.act_fn")}
    assert asis and all("fp32" in row["in"] for row in asis.values()), asis


# Every MoE family the sweep runs, at sizes no other test uses (expert counts, widths, top-k): transformers' own
# grouped_mm experts, a shared expert where the family has one, GatedDeltaNet layers for Qwen3.5-MoE (batch 1: torch's
# aot_eager backward fails on GatedDeltaNet at batch >= 2, and the logits here need no backward but keep the sweep's shape)
EAGER_FIX_FAMILIES: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48), 2),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=9, num_experts_per_tok=2, moe_intermediate_size=40), 2),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=72), 2),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=6, num_experts_per_tok=3, intermediate_size=40), 2),
    "glm4-moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1), 2),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=40,
                                                           sliding_window=6), 2),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                         layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=4), 1),
}  # fmt: skip


@pytest.mark.parametrize("family", list(EAGER_FIX_FAMILIES))
def test_the_eager_fix_alone_gives_the_backends_logits_and_no_more_fp32_outputs_than_a_hand_fix(family: str) -> None:
    """``eager_casts(...).apply(model)`` and nothing else (its hooks and its gathers: the experts' weights read at bf16 as
    the backend's weight-read casts read them) gives the logits of ``torch.compile(model, backend=precision backend with
    aot_eager)`` bit for bit, and the census of its forward holds no more fp32 module outputs than a hand fix (every
    embedding's and norm's output cast to bf16)."""
    import transformers

    from fx_precision.census import census
    from fx_precision.logprobs import logits_of
    from fx_precision.tools.sweep import hand_fixed

    config_cls, model_cls, moe, batch = EAGER_FIX_FAMILIES[family]
    dims = {**DIMS, "head_dim": 12, "hidden_size": 48, "intermediate_size": 56, **moe}
    torch.manual_seed(3)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**dims)).float().eval()
    ids = torch.randint(0, DIMS["vocab_size"], (batch, 12), generator=torch.Generator().manual_seed(4))
    policy = PrecisionPolicy(compute="bf16")
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        compiled = logits_of(torch.compile(model, backend=fxp.make_precision_backend(policy=policy, inner="aot_eager"))(input_ids=ids))
    torch._dynamo.reset()
    fix = fxp.eager_casts(model, input_ids=ids, policy=policy)
    assert fix.gathers, family  # the experts' weight reads: a cast no output hook makes
    with fix.apply(model), torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        eager = logits_of(model(input_ids=ids))
        fixed = census(model, input_ids=ids)
    assert torch.equal(eager, compiled), (family, int((eager != compiled).sum()), eager.numel())
    with hand_fixed(model), torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        by_hand = census(model, input_ids=ids)

    def fp32_outputs(c: Any) -> int:
        return sum(1 for e in c.entries if e.direction == "out" and e.dtype == "fp32")

    assert fp32_outputs(fixed) <= fp32_outputs(by_hand), (family, fp32_outputs(fixed), fp32_outputs(by_hand))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters: the gathers read them, never change them
