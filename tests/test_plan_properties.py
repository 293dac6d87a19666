"""Property tests: random module trees x random specs, checked against an FSDP2 claim simulation.

For every plan: each floating parameter is claimed by exactly one unit, each unit's parameters
gather at its dtype, no unit contains a unit that comes after it, and no precision unit can be
dropped (minimality, also checked exactly by brute force on small trees).
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from fx_precision import PrecisionError, PrecisionPlan, compile_precision, parse_precision_rules
from tests.model_trees import tree_from_spec

DTYPES = ["fp32", "bf16", "fp16"]
NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def shapes(depth: int = 3) -> st.SearchStrategy[dict]:
    leaf = st.fixed_dictionaries({"p": st.lists(st.integers(1, 3), max_size=2)})
    return st.recursive(
        leaf,
        lambda kids: st.fixed_dictionaries({"p": st.lists(st.integers(1, 3), max_size=2), "kids": st.lists(kids, min_size=1, max_size=3)}),
        max_leaves=8,
    )


@st.composite
def model_and_rules(draw: st.DrawFn) -> tuple[nn.Module, str, list[str]]:
    model = tree_from_spec(draw(shapes()))
    module_fqns = [n for n, m in model.named_modules() if any(True for _ in m.parameters())]
    param_fqns = [n for n, _ in model.named_parameters()]
    assume(param_fqns)
    rules = []
    for _ in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        if draw(st.booleans()):
            rules.append(f"param:{draw(st.sampled_from(param_fqns))}={dtype}")
        else:
            target = draw(st.sampled_from(module_fqns))
            rules.append(f"{target or '*'}={dtype}")
    all_fqns = [n for n, _ in model.named_modules() if n]
    wrap = draw(st.lists(st.sampled_from(all_fqns), max_size=2, unique=True)) if all_fqns else []
    return model, "; ".join(rules), wrap


def claims(model: nn.Module, order: list[str]) -> dict[int, str]:
    """FSDP2's rule: fully_shard claims every parameter reachable from it not claimed before."""
    owner: dict[int, str] = {}
    for fqn in order:
        module = model.get_submodule(fqn) if fqn else model
        for _, p in module.named_parameters():
            owner.setdefault(id(p), fqn)
    return owner


def consistent(model: nn.Module, plan: PrecisionPlan, order: list[str], gathers: dict[str, torch.dtype]) -> bool:
    owner = claims(model, order)
    for fqn, p in model.named_parameters():
        if gathers[owner[id(p)]] != plan.param(fqn).gather:
            return False
    return True


def compile_or_reject(model: nn.Module, rules: str, wrap: list[str]) -> PrecisionPlan:
    try:
        return compile_precision(model, parse_precision_rules(rules), default_gather="fp32", wrap=wrap)
    except PrecisionError as exc:
        # the only legitimate rejections on these trees: a module with two gather dtypes among its
        # direct parameters, or a root-held parameter asked to gather at a non-default dtype
        assert "different gather dtypes" in str(exc) or "homed at the root" in str(exc), str(exc)
        assume(False)
        raise


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_rules())
def test_plan_invariants(case: tuple[nn.Module, str, list[str]]) -> None:
    model, rules, wrap = case
    plan = compile_or_reject(model, rules, wrap)
    order = list(plan.unit_fqns)
    gathers = {u.fqn: u.gather for u in plan.units}

    # every floating parameter belongs to exactly one unit, and FSDP2 would claim it there
    listed = [p for u in plan.units for p in u.params]
    assert sorted(listed) == sorted(n for n, _ in model.named_parameters())
    owner = claims(model, order)
    for fqn, p in model.named_parameters():
        assert plan.param(fqn).unit == owner[id(p)]
    # each unit's parameters all gather at the unit's dtype
    for unit in plan.units:
        assert all(plan.param(p).gather == unit.gather for p in unit.params)
    # the root is last and at the default; no unit contains a unit that comes after it
    assert order[-1] == "" and gathers[""] == torch.float32
    for i, outer in enumerate(order):
        for inner in order[i + 1 :]:
            assert not (outer == "" or inner.startswith(outer + ".")), (outer, inner)
    # removing any precision unit breaks the contract
    for unit in plan.units:
        if unit.kind != "precision":
            continue
        reduced = [u for u in order if u != unit.fqn]
        assert not consistent(model, plan, reduced, gathers), f"unit {unit.fqn} is redundant"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_rules())
def test_plan_is_globally_minimal_on_small_trees(case: tuple[nn.Module, str, list[str]]) -> None:
    """Brute force over every unit set no larger than the plan's: none is smaller and valid."""
    model, rules, wrap = case
    plan = compile_or_reject(model, rules, wrap)
    forced = [u.fqn for u in plan.units if u.kind != "precision"]
    optional = [f for f, _ in model.named_modules() if f not in forced]
    n_precision = sum(u.kind == "precision" for u in plan.units)
    assume(len(optional) <= 10)

    def post_order_key(fqn: str) -> tuple[int, str]:
        return (-fqn.count(".") - (1 if fqn else 0), fqn)

    for size in range(n_precision):
        for extra in itertools.combinations(optional, size):
            order = sorted([*forced, *extra], key=post_order_key)
            owner = claims(model, order)
            dtypes: dict[str, set[torch.dtype]] = {}
            for fqn, p in model.named_parameters():
                dtypes.setdefault(owner[id(p)], set()).add(plan.param(fqn).gather)
            valid = all(len(d) == 1 for d in dtypes.values()) and dtypes.get("", {torch.float32}) == {torch.float32}
            assert not valid, f"{extra} ({size} units) beats the plan's {n_precision}"
