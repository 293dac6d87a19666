"""The plan compiler: per-parameter dtypes, minimal units, order and errors.

Each docstring draws the module tree with the gather dtype every node ends up with;
``[unit]`` marks a wrap unit, ``{dtype}`` the dtype a node's parameters gather at.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fx_precision import PrecisionError, PrecisionPlan, PrecisionSpec, compile_precision, parse_precision_rules
from fx_precision.spec import DEFAULT, ModuleSel, Rule
from tests.model_trees import Leaf, Net

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def plan_of(model: nn.Module, rules: str = "", **kwargs: object) -> PrecisionPlan:
    kwargs.setdefault("default_gather", F32)
    return compile_precision(model, parse_precision_rules(rules), **kwargs)  # type: ignore[arg-type]


def units(plan: PrecisionPlan) -> dict[str, torch.dtype]:
    return {u.fqn: u.gather for u in plan.units}


def test_default_only_is_one_root_unit() -> None:
    """
    Net [unit] {fp32}
    ├── embed {fp32}
    ├── layers.0 (attn, mlp, norm) {fp32}
    ├── layers.1 (attn, mlp, norm) {fp32}
    └── head {fp32}
    """
    plan = plan_of(Net())
    assert units(plan) == {"": F32}
    assert all(p.gather == F32 and p.unit == "" for p in plan.params.values())
    assert len(plan.params) == 8


def test_one_module_override_is_one_unit() -> None:
    """
    Net [unit] {fp32}
    ├── embed [unit] {bf16}     <- embed=bf16
    ├── layers.* {fp32}
    └── head {fp32}
    """
    plan = plan_of(Net(), "embed=bf16")
    assert units(plan) == {"embed": BF16, "": F32}
    assert plan.param("embed.weight").gather == BF16
    assert plan.param("embed.weight").gather_rule == "embed=bf16"
    assert plan.param("head.weight").gather == F32


def test_a_plan_names_each_rule_as_its_own_spec_wrote_it() -> None:
    """Rules equal but for their text (one built in code, one parsed) each keep their own text in the plan's
    report, in either order in one process: a rule's text is never looked up by the rule's equality."""
    built = compile_precision(Net(), PrecisionSpec((Rule(ModuleSel(fqn="embed"), gather=BF16),)), default_gather=F32)
    parsed = plan_of(Net(), "embed=bf16")
    assert built.param("embed.weight").gather_rule == "embed=gather:bf16"
    assert parsed.param("embed.weight").gather_rule == "embed=bf16"


def test_class_glob_override_makes_each_matching_module_a_unit() -> None:
    """
    Net [unit] {fp32}
    ├── embed {fp32}
    ├── layers.0 {fp32}
    │   ├── attn, mlp {fp32}
    │   └── norm [unit] {bf16}   <- cls:Norm=bf16
    ├── layers.1 {fp32}
    │   └── norm [unit] {bf16}
    └── head {fp32}
    """
    plan = plan_of(Net(), "cls:Norm=bf16")
    assert units(plan) == {"layers.0.norm": BF16, "layers.1.norm": BF16, "": F32}


def test_whole_subtree_at_one_dtype_is_one_unit_not_one_per_child() -> None:
    """
    Net [unit] {fp32}
    ├── layers.0 [unit] {bf16}  <- layers.0=bf16 (attn, mlp, norm all bf16: one unit)
    ├── layers.1 {fp32}
    └── ...
    """
    plan = plan_of(Net(), "layers.0=bf16")
    assert units(plan) == {"layers.0": BF16, "": F32}
    assert set(plan.unit("layers.0").params) == {"layers.0.attn.weight", "layers.0.mlp.weight", "layers.0.norm.weight"}


def test_subtree_selected_child_by_child_still_lifts_to_one_unit() -> None:
    """A glob over the children of a module with no own parameters: the unit sits at the parent.

    Net [unit] {fp32}
    ├── layers.0 [unit] {bf16}  <- layers.0.*=bf16 selects attn, mlp, norm
    │   ├── attn {bf16}, mlp {bf16}, norm {bf16}
    └── layers.1, embed, head {fp32}
    """
    plan = plan_of(Net(), "layers.0.*=bf16")
    assert units(plan) == {"layers.0": BF16, "": F32}


def test_nested_flip_back_child_is_its_own_unit_and_nothing_more() -> None:
    """
    Net [unit] {fp32}
    ├── layers.0 [unit] {bf16}    <- layers.0=bf16
    │   ├── attn {bf16}
    │   ├── mlp [unit] {fp32}     <- layers.0.mlp=fp32 (flips back)
    │   └── norm {bf16}
    └── everything else {fp32}
    """
    plan = plan_of(Net(), "layers.0=bf16; layers.0.mlp=fp32")
    assert units(plan) == {"layers.0.mlp": F32, "layers.0": BF16, "": F32}
    assert plan.unit("layers.0").params == ("layers.0.attn.weight", "layers.0.norm.weight")


def test_flip_back_of_the_only_parameter_needs_no_unit() -> None:
    """Flipping a child back to the parent's dtype when nothing else differs: no unit at all.

    Net [unit] {fp32}
    └── layers.0.mlp {fp32}   <- layers.0.mlp=bf16 then layers.0.mlp=fp32 (last match wins)
    """
    plan = plan_of(Net(), "layers.0.mlp=bf16; layers.0.mlp=fp32")
    assert units(plan) == {"": F32}


def test_structural_wrap_units_combine_with_precision_units() -> None:
    """
    Net [unit] {fp32}
    ├── embed [unit] {bf16}        <- embed=bf16
    ├── layers.0 [unit, wrap] {fp32}
    │   └── norm [unit] {bf16}     <- cls:Norm=bf16
    ├── layers.1 [unit, wrap] {fp32}
    │   └── norm [unit] {bf16}
    └── head {fp32}

    order: embed, layers.0.norm, layers.0, layers.1.norm, layers.1, <root>
    """
    plan = plan_of(Net(), "embed=bf16; cls:Norm=bf16", wrap=["layers.*"])
    assert plan.unit_fqns == ("embed", "layers.0.norm", "layers.0", "layers.1.norm", "layers.1", "")
    assert [u.kind for u in plan.units] == ["precision", "precision", "wrap", "precision", "wrap", "root"]
    assert units(plan)["layers.0"] == F32


def test_wrap_unit_whose_subtree_is_all_one_dtype_takes_that_dtype() -> None:
    """A wrap unit with no direct parameters gathers at its subtree's dtype (no extra units).

    Net [unit] {fp32}
    ├── layers.0 [unit, wrap] {bf16}   <- layers.0=bf16: one unit, not four
    └── layers.1 [unit, wrap] {fp32}
    """
    plan = plan_of(Net(), "layers.0=bf16", wrap=["layers.*"])
    assert units(plan) == {"layers.0": BF16, "layers.1": F32, "": F32}


def test_last_match_wins_per_axis() -> None:
    """
    Net [unit] {fp32}
    ├── embed [unit] {fp16}      <- *=bf16 (gather), embed=master:bf16, embed=gather:fp16
    ├── layers.* [unit] {bf16}   <- *=bf16
    └── head  {fp32}             <- head=default: back to the run default, the root's fp32
    The root holds no parameter of its own, so it gathers at the default fp32.
    """
    net = Net()
    plan = plan_of(net, "*=gather:bf16; embed=master:bf16; embed=gather:fp16; head=default")
    embed = plan.param("embed.weight")
    assert (embed.gather, embed.master) == (F16, BF16)
    assert plan.param("head.weight").gather == F32  # 'default' resets to the run default
    assert plan.param("layers.1.mlp.weight").gather == BF16
    assert plan.param("layers.1.mlp.weight").master == F32  # master untouched: the parameter's own dtype


def test_master_only_rules_create_no_unit() -> None:
    """
    Net [unit] {fp32}          master: layers.*.norm.weight bf16, rest fp32 (as loaded)
    └── (gather fp32 everywhere: no unit beyond the root)
    """
    plan = plan_of(Net(), "param:*.norm.weight=master:bf16")
    assert units(plan) == {"": F32}
    assert plan.param("layers.0.norm.weight").master == BF16
    assert plan.param("layers.0.attn.weight").master == F32


def test_default_master_applies_unless_a_rule_overrides() -> None:
    """Net [unit] {fp32}, master fp32 by default_master, embed master bf16 by rule."""
    net = Net().to(BF16)
    plan = plan_of(net, "embed=master:bf16", default_master="fp32")
    assert plan.param("head.weight").master == F32
    assert plan.param("embed.weight").master == BF16


def test_zero_hit_module_rule_suggests_nearest_fqn() -> None:
    """Net: 'embd' selects nothing -> error naming the rule and suggesting 'embed'."""
    with pytest.raises(PrecisionError, match=r"rule 'embd=bf16' selects no module; nearest modules: embed"):
        plan_of(Net(), "embd=bf16")


def test_zero_hit_class_rule_suggests_nearest_class() -> None:
    with pytest.raises(PrecisionError, match=r"rule 'cls:Nrom=bf16' selects no module class; nearest classes: Norm"):
        plan_of(Net(), "cls:Nrom=bf16")


def test_zero_hit_param_rule_suggests_nearest_parameter() -> None:
    with pytest.raises(PrecisionError, match=r"selects no parameter; nearest parameters: .*embed.weight"):
        plan_of(Net(), "param:embed.wieght=bf16")


def test_rule_on_parameterless_module_is_an_error() -> None:
    net = Net()
    net.act = nn.SiLU()
    with pytest.raises(PrecisionError, match="hold no floating parameter"):
        plan_of(net, "act=bf16")


def test_two_gather_dtypes_among_direct_parameters_is_an_error() -> None:
    """
    Leaf(weight {bf16}, bias {fp32})  <- param:*.weight=bf16 : one module, two gather dtypes
    No module boundary separates weight and bias -> error naming both.
    """
    net = nn.Module()
    net.lin = Leaf(bias=True)
    with pytest.raises(
        PrecisionError, match=r"module 'lin' holds parameters that need different gather dtypes \(lin.weight=bf16, lin.bias=fp32\)"
    ):
        plan_of(net, "param:lin.weight=bf16")


def test_gather_rule_on_a_buffer_is_an_error() -> None:
    net = Net()
    net.embed.register_buffer("table", torch.zeros(3))
    with pytest.raises(PrecisionError, match=r"gather dtype on buffer\(s\) embed.table"):
        plan_of(net, "param:*table=bf16")


def test_tied_parameters_with_conflicting_explicit_rules_are_an_error() -> None:
    """
    Net [unit]
    ├── embed {bf16?}  ─┐ one Parameter, two names
    └── head  {fp32?}  ─┘ <- embed=bf16 and head=fp32: two explicit rules disagree -> error naming both
    """
    net = Net()
    net.head.weight = net.embed.weight
    with pytest.raises(PrecisionError, match=r"tied parameter embed.weight \(also head.weight\).*'embed=bf16'.*'head=fp32'"):
        plan_of(net, "embed=bf16; head=fp32")


def test_a_rule_on_one_alias_of_a_tied_parameter_makes_a_group_unit() -> None:
    """One object, one dtype: the explicit rule on one alias wins over the default on the other.

    Net [unit] {fp32}
    ├── embed ─┐ group unit embed+head {bf16}   <- embed=bf16   fully_shard([embed, head])
    ├── head  ─┘
    └── layers.* [wrap] {fp32}
    order: layers.0, layers.1, embed+head, <root>
    """
    net = Net()
    net.head.weight = net.embed.weight
    plan = plan_of(net, "embed=bf16", wrap=["layers.*"])
    (group,) = [u for u in plan.units if u.kind == "group"]
    assert (group.group, group.gather, group.params) == (("embed", "head"), BF16, ("embed.weight",))
    assert plan.unit_fqns == ("layers.0", "layers.1", "embed", "")
    assert plan.param("head.weight").gather == BF16 and plan.param("head.weight").unit == "embed"
    assert "stays alive from its first use to its last" in group.reason
    assert "embed+head" in plan.explain()
    same = plan_of(net, "embed=bf16; head=bf16", wrap=["layers.*"])  # agreeing rules on both aliases: the same plan
    assert same.units == plan.units


def test_tied_parameter_is_homed_at_the_common_ancestor() -> None:
    """
    Net [unit] {fp32}   <- embed.weight == head.weight lives here (encloses both uses)
    ├── layers.0 [unit] {bf16}
    """
    net = Net()
    net.head.weight = net.embed.weight
    plan = plan_of(net, "layers.0=bf16")
    assert plan.param("head.weight").unit == ""
    assert plan.param("head.weight").aliases == ("embed.weight", "head.weight")


def test_gather_override_on_the_roots_own_parameters_is_an_error() -> None:
    """
    Net [unit] {fp32 = default_gather}
    ├── scale {bf16}   <- param:scale=bf16: the root unit gathers at the default; no unit can express it
    """
    net = Net()
    net.scale = nn.Parameter(torch.ones(2))
    with pytest.raises(PrecisionError, match=r"homed at the root.*scale.*default_gather=fp32"):
        plan_of(net, "param:scale=bf16")


def test_shared_module_under_two_units_becomes_its_own_unit_first() -> None:
    """A block shared by two wrapped parents: FSDP2 claims by reachability, so it is a unit.

    Net [unit] {fp32}
    ├── a [wrap] {fp32} ─┐
    │                    ├── shared [unit] {bf16}   (one object, two parents)
    ├── b [wrap] {fp32} ─┘
    order: shared, a, b, <root>   (shared before both parents that contain it)
    """
    net = nn.Module()
    shared = Leaf()
    net.a = nn.Module()
    net.a.own = Leaf()
    net.a.s = shared
    net.b = nn.Module()
    net.b.own = Leaf()
    net.b.s = shared
    plan = plan_of(net, "a.s=bf16; b.s=bf16", wrap=["a", "b"])
    order = plan.unit_fqns
    assert order.index("a.s") < order.index("a") and order.index("a.s") < order.index("b")
    assert units(plan)["a.s"] == BF16
    # the same shared block at fp32 under wrapped parents still must be its own unit
    plan32 = plan_of(net, wrap=["a", "b"])
    assert "a.s" in plan32.unit_fqns
    assert plan32.param("a.s.weight").unit == "a.s"


def test_compiling_never_modifies_the_model() -> None:
    net = Net()
    before = copy.deepcopy(net.state_dict())
    ids = {n: id(p) for n, p in net.named_parameters()}
    plan_of(net, "embed=bf16; cls:Norm=master:bf16", wrap=["layers.*"])
    with pytest.raises(PrecisionError):
        plan_of(net, "embd=bf16")
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert ids == {n: id(p) for n, p in net.named_parameters()}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_explain_table_and_json_round_trip() -> None:
    net = Net()
    plan = plan_of(net, "embed=bf16", wrap=["layers.*"])
    table = plan.explain()
    for header in ("unit", "modules", "#params", "gather bytes", "gather", "master", "deciding rule"):
        assert header in table
    assert "embed=bf16" in table
    again = PrecisionPlan.from_json(plan.to_json(), net)
    assert again.units == plan.units and again.params == plan.params


def test_json_against_another_model_is_rejected() -> None:
    plan = plan_of(Net(), "embed=bf16")
    with pytest.raises(PrecisionError, match="does not match this model"):
        PrecisionPlan.from_json(plan.to_json(), Net(n_layers=3))


def test_python_api_rules_match_parsed_rules() -> None:
    spec = PrecisionSpec((Rule(ModuleSel(fqn="embed"), gather=BF16), Rule(ModuleSel(cls="Block"), master=DEFAULT)))
    a = compile_precision(Net(), spec, default_gather=F32)
    b = plan_of(Net(), "embed=bf16; cls:Block=master:default")
    assert [(u.fqn, u.gather, u.params) for u in a.units] == [(u.fqn, u.gather, u.params) for u in b.units]
    assert {k: (p.gather, p.master) for k, p in a.params.items()} == {k: (p.gather, p.master) for k, p in b.params.items()}


def test_block_class_and_fqn_selector() -> None:
    """layers.1&cls:Block=bf16 -> layers.1 [unit] {bf16}; layers.0 stays fp32."""
    plan = plan_of(Net(), "layers.1&cls:Block=bf16")
    assert units(plan) == {"layers.1": BF16, "": F32}
    with pytest.raises(PrecisionError, match="selects no module class; nearest classes: Block"):
        plan_of(Net(), "layers.1&cls:Blok=bf16")
