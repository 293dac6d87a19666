"""Lowering a ``PrecisionSpec`` onto a model: one dtype per parameter per axis, and wrap units.

For tiny Qwen3.5 with ``*embed_tokens=bf16``, ``default_gather=fp32`` and
``wrap=("model.layers.*",)`` the plan is::

    <root>  Qwen3_5ForCausalLM      unit (root)       gather fp32   lm_head, model.norm
    ├── model.embed_tokens          unit (precision)  gather bf16   <- *embed_tokens=bf16
    ├── model.layers.0              unit (wrap)       gather fp32
    ├── ...
    └── model.layers.3              unit (wrap)       gather fp32

    apply order: model.embed_tokens, model.layers.0 … model.layers.3, <root>   (inner first)

Semantics (see DESIGN.md, "Plan semantics"):

* every floating parameter folds the rules that select it, in order; last match wins per axis;
  axes no rule sets take the run defaults (``default_gather``; ``default_master`` or, when that
  is ``None``, the parameter's current dtype);
* units = the root (always at ``default_gather``) + the modules ``wrap`` names + the fewest
  precision units, each as high in the tree as its parameters allow, such that every parameter
  gathers at the dtype of the unit that claims it. Parameters are homed at the dominator of
  their holders (tied weights at the common ancestor of their users; FSDP2 needs that).
* compiling never modifies the model.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from fx_precision.dtypes import dtype_name, parse_dtype
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import ModuleGraph, ParamInfo, collect_params
from fx_precision.spec import DEFAULT, AxisDtype, ParamSel, PrecisionSpec, Rule

ROOT_NAME = "<root>"


def unit_label(fqn: str) -> str:
    return fqn if fqn else ROOT_NAME


@dataclass(frozen=True)
class ParamPlan:
    """The plan for one parameter object (``fqn`` is its first name; ``aliases`` all of them)."""

    fqn: str
    aliases: tuple[str, ...]
    numel: int
    gather: torch.dtype
    master: torch.dtype
    gather_rule: str | None
    master_rule: str | None
    unit: str


@dataclass(frozen=True)
class UnitPlan:
    """One ``fully_shard`` call: the module at ``fqn`` with ``param_dtype=gather``.

    ``kind``: ``root`` | ``wrap`` (asked for by ``wrap=``) | ``precision`` (needed by the spec) |
    ``group`` (the modules in ``group`` sharing a tied parameter, sharded by one
    ``fully_shard([m1, m2])``; ``fqn`` is the first of them).
    ``params``: canonical FQNs of the parameters this unit claims. ``modules``: FQNs of the
    modules whose nearest enclosing unit this is.
    """

    fqn: str
    kind: str
    gather: torch.dtype
    params: tuple[str, ...]
    modules: tuple[str, ...]
    reason: str
    group: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How tables name the unit: ``<root>``, a module FQN, or ``a+b`` for a group unit."""
        return "+".join(self.group) if self.group else unit_label(self.fqn)


@dataclass
class PrecisionPlan:
    """Per-parameter dtypes on the gather and master axes, and units in apply order."""

    params: dict[str, ParamPlan]
    units: tuple[UnitPlan, ...]
    default_gather: torch.dtype
    default_master: torch.dtype | None
    spec_text: str = ""
    wrap: tuple[str, ...] = ()
    _alias: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._alias = {alias: p.fqn for p in self.params.values() for alias in p.aliases}

    # -- queries -------------------------------------------------------------------------------
    def param(self, fqn: str) -> ParamPlan:
        try:
            return self.params[self._alias[fqn]]
        except KeyError:
            raise PrecisionError(f"parameter {fqn!r} is not in this plan; was the plan compiled for this model?") from None

    def unit(self, fqn: str) -> UnitPlan:
        for unit in self.units:
            if unit.fqn == fqn:
                return unit
        raise PrecisionError(f"{unit_label(fqn)!r} is not a unit of this plan; units: {[unit_label(u.fqn) for u in self.units]}")

    def unit_of_module(self, fqn: str) -> UnitPlan:
        """The unit whose forward gathers the module at ``fqn`` (its nearest enclosing unit)."""
        for unit in self.units:
            if fqn in unit.modules:
                return unit
        raise PrecisionError(f"module {fqn!r} is not in this plan; was the plan compiled for this model?")

    @property
    def unit_fqns(self) -> tuple[str, ...]:
        return tuple(unit.fqn for unit in self.units)

    # -- presentation ----------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for unit in self.units:
            params = [self.params[p] for p in unit.params]
            masters = sorted({dtype_name(p.master) for p in params})
            rows.append(
                {
                    "unit": unit.label,
                    "kind": unit.kind,
                    "modules": len(unit.modules),
                    "params": len(params),
                    "numel": sum(p.numel for p in params),
                    "bytes": sum(p.numel for p in params) * unit.gather.itemsize,
                    "gather": dtype_name(unit.gather),
                    "master": ",".join(masters) if masters else "-",
                    "rule": unit.reason,
                }
            )
        return rows

    def explain(self) -> str:
        """A table: unit, kind, modules, #params, gather bytes, gather, master, deciding rule."""
        rows = self.rows()
        table = tabulate(
            [
                [r["unit"], r["kind"], r["modules"], r["params"], _human_bytes(r["bytes"]), r["gather"], r["master"], r["rule"]]
                for r in rows
            ],
            headers=["unit (apply order)", "kind", "modules", "#params", "gather bytes", "gather", "master", "deciding rule"],
        )
        master = dtype_name(self.default_master) if self.default_master else "as loaded"
        head = f"default gather {dtype_name(self.default_gather)}, default master {master}"
        return f"{head}; spec: {self.spec_text or '(none)'}\n{table}"

    # -- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "default_gather": dtype_name(self.default_gather),
            "default_master": dtype_name(self.default_master) if self.default_master else None,
            "spec": self.spec_text,
            "wrap": list(self.wrap),
            "units": [
                {
                    "fqn": u.fqn,
                    "kind": u.kind,
                    "group": list(u.group),
                    "gather": dtype_name(u.gather),
                    "params": list(u.params),
                    "modules": list(u.modules),
                    "rule": u.reason,
                }
                for u in self.units
            ],
            "params": {
                p.fqn: {
                    "aliases": list(p.aliases),
                    "numel": p.numel,
                    "gather": dtype_name(p.gather),
                    "master": dtype_name(p.master),
                    "gather_rule": p.gather_rule,
                    "master_rule": p.master_rule,
                    "unit": p.unit,
                }
                for p in self.params.values()
            },
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | dict[str, Any], model: nn.Module) -> PrecisionPlan:
        """Load a plan and check it against ``model`` (same parameters, sizes and modules)."""
        data = json.loads(text) if isinstance(text, str) else text
        if data.get("version") != 1:
            raise PrecisionError(
                f"plan JSON version {data.get('version')!r} is not supported (expected 1); recompile the plan and save it with to_json()"
            )
        params = {
            fqn: ParamPlan(
                fqn=fqn,
                aliases=tuple(p["aliases"]),
                numel=int(p["numel"]),
                gather=parse_dtype(p["gather"], what=f"plan JSON, parameter {fqn}"),
                master=parse_dtype(p["master"], what=f"plan JSON, parameter {fqn}"),
                gather_rule=p["gather_rule"],
                master_rule=p["master_rule"],
                unit=p["unit"],
            )
            for fqn, p in data["params"].items()
        }
        model_params = {fqn: p for fqn, p in model.named_parameters() if p.is_floating_point()}
        missing = sorted(set(model_params) - set(params))
        extra = sorted(set(params) - set(model_params))
        if missing or extra:
            raise PrecisionError(
                f"plan JSON does not match this model: parameters missing from the plan {missing[:5]}, "
                f"in the plan but not the model {extra[:5]}; recompile the plan for this model"
            )
        for fqn, p in params.items():
            if model_params[fqn].numel() != p.numel:
                raise PrecisionError(
                    f"plan JSON does not match this model: {fqn} has {model_params[fqn].numel()} elements, "
                    f"the plan says {p.numel}; recompile the plan for this model"
                )
        module_fqns = {fqn for fqn, _ in model.named_modules()}
        units = []
        for u in data["units"]:
            if u["fqn"] not in module_fqns:
                raise PrecisionError(f"plan JSON unit {unit_label(u['fqn'])!r} is not a module of this model; recompile the plan")
            units.append(
                UnitPlan(
                    u["fqn"],
                    u["kind"],
                    parse_dtype(u["gather"]),
                    tuple(u["params"]),
                    tuple(u["modules"]),
                    u["rule"],
                    tuple(u.get("group", ())),
                )
            )
        dm = data.get("default_master")
        return cls(
            params=params,
            units=tuple(units),
            default_gather=parse_dtype(data["default_gather"]),
            default_master=parse_dtype(dm) if dm else None,
            spec_text=data.get("spec", ""),
            wrap=tuple(data.get("wrap", ())),
        )


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


# ---------------------------------------------------------------------------------------------
# rule resolution
# ---------------------------------------------------------------------------------------------


def _suggest(pattern: str, names: Iterable[str], n: int = 3) -> list[str]:
    names = sorted(set(names))
    bare = pattern.replace("*", "").replace("?", "")
    scored: list[tuple[float, str]] = []
    for name in names:
        tail_scores = [difflib.SequenceMatcher(None, bare, name).ratio()]
        parts = name.split(".")
        for i in range(len(parts)):
            tail_scores.append(difflib.SequenceMatcher(None, bare, ".".join(parts[i:])).ratio())
        scored.append((max(tail_scores), name))
    scored.sort(key=lambda s: (-s[0], len(s[1]), s[1]))
    return [name for score, name in scored[:n] if score >= 0.5]


def _zero_hit(rule: Rule, what: str, pattern: str, names: Iterable[str], kind: str) -> PrecisionError:
    hint = _suggest(pattern, names)
    nearest = f"; nearest {kind}: {', '.join(hint)}" if hint else ""
    return PrecisionError(f"rule {rule.text()!r} selects no {what}{nearest}. Fix the glob or drop the rule.")


@dataclass
class _Resolved:
    dtype: torch.dtype
    rule: str | None


def _resolve_axis(rules: Sequence[tuple[Rule, set[str]]], alias: str, axis: str, default: torch.dtype) -> _Resolved:
    out = _Resolved(default, None)
    for rule, selected in rules:
        value: AxisDtype | None = getattr(rule, axis)
        if value is None or alias not in selected:
            continue
        out = _Resolved(default if value is DEFAULT else value, rule.text())  # type: ignore[arg-type]
    return out


def _selected_aliases(
    rule: Rule, module_paths: list[tuple[str, nn.Module]], param_aliases: dict[str, ParamInfo], buffers: list[str]
) -> set[str]:
    """The parameter FQNs (all aliases, floating only) a rule selects; raises on zero hits."""
    sel = rule.select
    floating = {a for a, info in param_aliases.items() if info.param.is_floating_point()}
    if isinstance(sel, ParamSel):
        hits = {a for a in param_aliases if sel.matches(a)}
        buffer_hits = [b for b in buffers if sel.matches(b)]
        if buffer_hits and rule.gather is not None:
            raise PrecisionError(
                f"rule {rule.text()!r} puts a gather dtype on buffer(s) {', '.join(buffer_hits[:3])}: FSDP2 gathers "
                "parameters only, buffers keep their own dtype. Narrow the glob so it selects parameters only."
            )
        if not hits:
            if buffer_hits:
                raise PrecisionError(
                    f"rule {rule.text()!r} selects only buffer(s) {', '.join(buffer_hits[:3])}, no parameter; "
                    "buffers have no master or gather axis. Drop the rule."
                )
            raise _zero_hit(rule, "parameter", sel.fqn, param_aliases, "parameters")
        float_hits = hits & floating
        if not float_hits:
            raise PrecisionError(
                f"rule {rule.text()!r} selects only non-floating parameters ({', '.join(sorted(hits)[:3])}); "
                "precision rules apply to floating parameters. Drop the rule."
            )
        return float_hits
    matched = [path for path, mod in module_paths if sel.matches(path, mod)]
    if not matched:
        by_fqn = [(p, m) for p, m in module_paths if sel.fqn is None or fnmatch.fnmatchcase(p, sel.fqn)]
        if not by_fqn:
            raise _zero_hit(rule, "module", sel.fqn or "", (p for p, _ in module_paths if p), "modules")
        assert sel.cls is not None  # the FQN glob matched, so the class glob is what failed
        raise _zero_hit(rule, "module class", sel.cls, {type(m).__name__ for _, m in by_fqn}, "classes")
    prefixes = set(matched)
    hits = set()
    for alias in floating:
        owner = alias.rpartition(".")[0]
        parts = owner.split(".") if owner else []
        chain = [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]
        if any(c in prefixes for c in chain):
            hits.add(alias)
    if not hits:
        raise PrecisionError(
            f"rule {rule.text()!r} selects module(s) {', '.join(unit_label(m) for m in matched[:3])} but they hold no "
            "floating parameter; point it at a module with parameters or drop it."
        )
    return hits


# ---------------------------------------------------------------------------------------------
# unit selection
# ---------------------------------------------------------------------------------------------


@dataclass
class _Choice:
    cost: int
    unit_dtype: torch.dtype | None  # None: not a unit
    tiebreak: tuple[int, ...]


class _UnitSolver:
    """Fewest precision units over the dominator tree (a DP over node x enclosing dtype).

    ``solve(m, d)`` = fewest precision units in m's dominator subtree when m's nearest enclosing
    unit gathers at ``d``. Forced units (root, ``wrap``) cost nothing; on a tie a unit higher up
    beats units further down, so a subtree that needs one other dtype becomes one unit.
    """

    def __init__(
        self,
        graph: ModuleGraph,
        direct: dict[int, set[torch.dtype]],
        forced: set[int],
        candidates: list[torch.dtype],
        default_gather: torch.dtype,
    ) -> None:
        self.graph = graph
        self.direct = direct
        self.forced = forced
        self.candidates = candidates
        self.default_gather = default_gather
        self.memo: dict[tuple[int, torch.dtype], _Choice] = {}
        self.has_params: dict[int, bool] = {}
        for key in self._dom_post_order():
            self.has_params[key] = bool(direct.get(key)) or any(self.has_params[c] for c in graph.dom_children[key])

    def _dom_post_order(self) -> list[int]:
        out: list[int] = []
        stack = [(id(self.graph.root), False)]
        while stack:
            key, done = stack.pop()
            if done:
                out.append(key)
                continue
            stack.append((key, True))
            for kid in self.graph.dom_children[key]:
                stack.append((kid, False))
        return out

    def _children_cost(self, key: int, d: torch.dtype) -> int:
        return sum(self.solve(kid, d).cost for kid in self.graph.dom_children[key])

    def solve(self, key: int, d: torch.dtype) -> _Choice:
        memo_key = (key, d)
        if memo_key in self.memo:
            return self.memo[memo_key]
        if not self.has_params[key] and key not in self.forced:
            choice = _Choice(0, None, (0,))
            self.memo[memo_key] = choice
            return choice
        own = self.direct.get(key, set())
        options: list[_Choice] = []
        is_root = key == id(self.graph.root)
        if key not in self.forced and own <= {d}:
            options.append(_Choice(self._children_cost(key, d), None, (1,)))
        dtypes = [self.default_gather] if is_root else (sorted(own, key=str) if own else self.candidates)
        for e in dtypes:
            unit_cost = 0 if key in self.forced else 1
            prefer = (0, 0 if e == d else 1, 0 if e == self.default_gather else 1, self.candidates.index(e))
            options.append(_Choice(unit_cost + self._children_cost(key, e), e, prefer))
        best = min(options, key=lambda c: (c.cost, c.tiebreak))
        self.memo[memo_key] = best
        return best

    def units(self) -> dict[int, torch.dtype]:
        """Walk the chosen decisions from the root: ``{module key: unit gather dtype}``."""
        chosen: dict[int, torch.dtype] = {}
        stack = [(id(self.graph.root), self.default_gather)]
        while stack:
            key, d = stack.pop()
            choice = self.solve(key, d)
            inner = d
            if choice.unit_dtype is not None:
                chosen[key] = choice.unit_dtype
                inner = choice.unit_dtype
            for kid in self.graph.dom_children[key]:
                if self.has_params[kid] or kid in self.forced:
                    stack.append((kid, inner))
        return chosen


def compile_precision(
    model: nn.Module,
    spec: PrecisionSpec | None = None,
    *,
    default_gather: torch.dtype | str,
    default_master: torch.dtype | str | None = None,
    wrap: Sequence[str] = (),
) -> PrecisionPlan:
    """Lower ``spec`` onto ``model``: per-parameter gather/master dtypes and ordered wrap units.

    ``wrap``: module-FQN globs whose outermost matches must be units of their own, whatever their
    dtype (``"model.layers.*"`` makes each decoder layer a unit, not every module below it).

    Raises ``PrecisionError`` (the model is never modified) when a rule selects nothing, a module's
    direct parameters need two gather dtypes, a gather rule hits a buffer, tied aliases disagree,
    or the root's own parameters need a non-default gather dtype.
    """
    spec = spec or PrecisionSpec()
    default_gather = parse_dtype(default_gather, what="default_gather")
    default_master = parse_dtype(default_master, what="default_master") if default_master is not None else None
    graph = ModuleGraph.of(model)
    infos = collect_params(graph)
    aliases: dict[str, ParamInfo] = {alias: info for info in infos.values() for alias in info.aliases}
    module_paths = list(model.named_modules(remove_duplicate=False))
    buffers = [name for name, _ in model.named_buffers(remove_duplicate=False)]

    selected = [(rule, _selected_aliases(rule, module_paths, aliases, buffers)) for rule in spec.rules]
    resolved = _resolve_params(infos, selected, default_gather, default_master)
    grouped = _group_units(graph, infos, resolved, default_gather)
    solved = {key: r for key, r in resolved.items() if key not in grouped.claims}
    direct = _direct_gathers(graph, infos, solved, default_gather)
    forced = _forced_units(graph, module_paths, wrap)
    candidates = sorted({default_gather} | {g.dtype for g, _ in solved.values()}, key=lambda d: (d != default_gather, str(d)))

    extra_forced: set[int] = set()
    while True:  # solve; force a shared module into a unit if FSDP2 would claim its weights wrongly
        chosen = _UnitSolver(graph, direct, set(forced) | extra_forced, candidates, default_gather).units()
        order = [key for key in graph.post_order if key in chosen]
        claims: dict[int, int] = {}
        for unit_key in order:
            for _, param in graph.modules[unit_key].named_parameters():
                if id(param) in solved and id(param) not in claims:
                    claims[id(param)] = unit_key
        fix = _check_claims(graph, infos, solved, chosen, claims)
        if fix is None:
            break
        if fix in extra_forced or fix in forced:  # pragma: no cover - defensive: no progress possible
            raise PrecisionError(f"cannot place module {graph.first_fqn[fix]!r} in a unit; please report this model")
        extra_forced.add(fix)

    params = {
        infos[key].fqn: ParamPlan(
            fqn=infos[key].fqn,
            aliases=tuple(infos[key].aliases),
            numel=infos[key].param.numel(),
            gather=g.dtype,
            master=m.dtype,
            gather_rule=g.rule,
            master_rule=m.rule,
            unit=grouped.claims[key].fqn if key in grouped.claims else graph.first_fqn[claims[key]],
        )
        for key, (g, m) in resolved.items()
    }
    units = _assemble_units(graph, order, chosen, claims, infos, params, forced, extra_forced, default_gather)
    units = _insert_groups(graph, units, grouped.units)
    return PrecisionPlan(
        params=params,
        units=tuple(units),
        default_gather=default_gather,
        default_master=default_master,
        spec_text=spec.text(),
        wrap=tuple(wrap),
    )


def _resolve_params(
    infos: dict[int, ParamInfo],
    selected: list[tuple[Rule, set[str]]],
    default_gather: torch.dtype,
    default_master: torch.dtype | None,
) -> dict[int, tuple[_Resolved, _Resolved]]:
    """(gather, master) per floating parameter, folded per alias; tied aliases must agree."""
    resolved: dict[int, tuple[_Resolved, _Resolved]] = {}
    for key, info in infos.items():
        if not info.param.is_floating_point():
            continue
        master_default = default_master or info.param.dtype
        per_alias = [
            (alias, _resolve_axis(selected, alias, "gather", default_gather), _resolve_axis(selected, alias, "master", master_default))
            for alias in info.aliases
        ]
        g0 = _merge_aliases(info, [(alias, g) for alias, g, _ in per_alias], "gather")
        m0 = _merge_aliases(info, [(alias, m) for alias, _, m in per_alias], "master")
        resolved[key] = (g0, m0)
    return resolved


def _merge_aliases(info: ParamInfo, per_alias: list[tuple[str, _Resolved]], axis: str) -> _Resolved:
    """One object, one dtype: an explicit rule on any alias wins over the run default on the others;
    two explicit rules that disagree are an error."""
    explicit = [(alias, r) for alias, r in per_alias if r.rule is not None]
    if not explicit:
        return per_alias[0][1]
    (first_alias, first), *others = explicit
    for alias, r in others:
        if r.dtype != first.dtype:
            raise PrecisionError(
                f"tied parameter {info.fqn} (also {', '.join(info.aliases[1:])}): rule {first.rule!r} gives alias {first_alias} "
                f"{axis} {dtype_name(first.dtype)} but rule {r.rule!r} gives alias {alias} {axis} {dtype_name(r.dtype)}. "
                "One object has one dtype: make the rules agree, or untie the weights."
            )
    return first


def _direct_gathers(
    graph: ModuleGraph, infos: dict[int, ParamInfo], resolved: dict[int, tuple[_Resolved, _Resolved]], default_gather: torch.dtype
) -> dict[int, set[torch.dtype]]:
    """Gather dtypes of the parameters homed at each module; raises where no unit can express them."""
    direct: dict[int, set[torch.dtype]] = {}
    home_params: dict[int, list[int]] = {}
    for key, (g, _) in resolved.items():
        home = infos[key].home
        direct.setdefault(home, set()).add(g.dtype)
        home_params.setdefault(home, []).append(key)
    for home, dtypes in direct.items():
        if len(dtypes) > 1:
            names = [f"{infos[k].fqn}={dtype_name(resolved[k][0].dtype)}" for k in home_params[home]]
            raise PrecisionError(
                f"module {unit_label(graph.first_fqn[home])!r} holds parameters that need different gather dtypes "
                f"({', '.join(names)}); one FSDP2 unit gathers at one dtype, and no module boundary separates them. "
                "Give them the same gather dtype, or move one into a submodule of its own."
            )
    root_key = id(graph.root)
    if direct.get(root_key, {default_gather}) != {default_gather}:
        names = [
            f"{infos[k].fqn} ({'tied: ' + ', '.join(infos[k].aliases) if len(infos[k].aliases) > 1 else 'direct'})"
            for k in home_params[root_key]
        ]
        rules = sorted({resolved[k][0].rule or "default" for k in home_params[root_key]})
        raise PrecisionError(
            f"rule(s) {', '.join(rules)} ask a non-default gather dtype for parameter(s) homed at the root "
            f"({', '.join(names)}); the root unit gathers at default_gather={dtype_name(default_gather)} and no inner unit "
            "can express it. Change default_gather, move the parameter into a submodule, or untie it."
        )
    return direct


@dataclass
class _Groups:
    units: list[tuple[UnitPlan, list[int]]]  # (group unit, keys of its holder modules)
    claims: dict[int, UnitPlan]  # parameter key -> the group unit that claims it


def _group_units(
    graph: ModuleGraph, infos: dict[int, ParamInfo], resolved: dict[int, tuple[_Resolved, _Resolved]], default_gather: torch.dtype
) -> _Groups:
    """A group unit (``fully_shard([m1, m2, ...])``) for each tied parameter gathered off the default.

    The tied parameter's home is the common dominator of its holders (the root for an embedding
    tied to ``lm_head``), which gathers at the default; a group of exactly the holding modules
    gathers it at its own dtype instead. FSDP2 claims every parameter reachable from the group's
    modules, so the holders' other parameters must need the same gather dtype.
    """
    groups = _Groups([], {})
    for key, (g, _) in resolved.items():
        info = infos[key]
        if len(info.holders) < 2 or g.dtype == default_gather:
            continue
        members = [graph.first_fqn[h] for h in info.holders]
        for holder in info.holders:
            for name, param in graph.modules[holder].named_parameters():
                other = resolved.get(id(param))
                if other is not None and id(param) != key and other[0].dtype != g.dtype:
                    raise PrecisionError(
                        f"tied parameter {info.fqn} (also {', '.join(info.aliases[1:])}) gathers at {dtype_name(g.dtype)} "
                        f"({g.rule}), so its modules {', '.join(members)} form one FSDP2 group unit; but "
                        f"{graph.first_fqn[holder]}.{name} in that group gathers at {dtype_name(other[0].dtype)}. Give them "
                        "one gather dtype, or keep the tied weight at the default gather and cast the embedding's output "
                        "instead (precision_backend's source cast under torch.compile; an eager forward hook otherwise)."
                    )
        label = "+".join(members)
        params = tuple(
            sorted({infos[id(p)].fqn for h in info.holders for _, p in graph.modules[h].named_parameters() if id(p) in resolved})
        )
        unit = UnitPlan(
            fqn=members[0],
            kind="group",
            gather=g.dtype,
            params=params,
            modules=tuple(members),
            reason=f"{g.rule}; tied: group {label}, the gathered weight stays alive from its first use to its last",
            group=tuple(members),
        )
        groups.units.append((unit, list(info.holders)))
        for h in info.holders:
            for _, param in graph.modules[h].named_parameters():
                if id(param) in resolved:
                    groups.claims[id(param)] = unit
    return groups


def _insert_groups(graph: ModuleGraph, units: list[UnitPlan], groups: list[tuple[UnitPlan, list[int]]]) -> list[UnitPlan]:
    """Each group unit goes before the first unit that contains one of its modules (so it claims first)."""
    out = list(units)
    for unit, holders in groups:
        members = set(unit.group)
        for member in members:
            for other in out:
                if other.kind != "group" and other.fqn == member:
                    raise PrecisionError(
                        f"module {member!r} is both a unit of its own ({other.reason}) and part of the tied group {unit.label}; "
                        "drop it from wrap= or untie the weights"
                    )
        holder_paths = [p for h in holders for p in graph.all_paths[h]]

        def contains(u: UnitPlan, paths: list[str] = holder_paths) -> bool:
            return any(u.fqn == "" or p == u.fqn or p.startswith(u.fqn + ".") for p in paths)

        at = next(i for i, u in enumerate(out) if u.kind != "group" and contains(u))
        out = [u if u.kind == "group" else replace(u, modules=tuple(m for m in u.modules if m not in members)) for u in out]
        out.insert(at, unit)
    return out


def _forced_units(graph: ModuleGraph, module_paths: list[tuple[str, nn.Module]], wrap: Sequence[str]) -> dict[int, str]:
    """The root and the outermost matches of each wrap glob ('model.layers.*': each layer, not all below)."""
    forced: dict[int, str] = {id(graph.root): "root"}
    for glob in wrap:
        hits = [path for path, _ in module_paths if path and fnmatch.fnmatchcase(path, glob)]
        if not hits:
            hint = _suggest(glob, (p for p, _ in module_paths if p))
            raise PrecisionError(f"wrap glob {glob!r} matches no module{'; nearest: ' + ', '.join(hint) if hint else ''}")
        for path in hits:
            if not any(path.startswith(other + ".") for other in hits):
                forced.setdefault(id(graph.module_at(path)), f"wrap {glob}")
    return forced


def _assemble_units(
    graph: ModuleGraph,
    order: list[int],
    chosen: dict[int, torch.dtype],
    claims: dict[int, int],
    infos: dict[int, ParamInfo],
    params: dict[str, ParamPlan],
    forced: dict[int, str],
    extra_forced: set[int],
    default_gather: torch.dtype,
) -> list[UnitPlan]:
    nearest_unit: dict[int, int] = {}
    for key in graph.modules:
        nearest_unit[key] = next(anc for anc in graph.dom_ancestors(key) if anc in chosen)
    unit_params: dict[int, list[str]] = {k: [] for k in chosen}
    for key, owner in claims.items():
        unit_params[owner].append(infos[key].fqn)
    units = []
    for key in order:
        kind = "root" if key == id(graph.root) else ("wrap" if key in forced else "precision")
        if kind == "root":
            reason = f"default_gather={dtype_name(default_gather)}"
        elif key in extra_forced:
            reason = "shared module (several parents)"
        else:
            rules = sorted({params[p].gather_rule or "default" for p in unit_params[key]})
            reason = ", ".join(rules) if rules else "(no parameters)"
            if kind == "wrap":
                reason = f"{forced[key]}; {reason}"
        units.append(
            UnitPlan(
                fqn=graph.first_fqn[key],
                kind=kind,
                gather=chosen[key],
                params=tuple(unit_params[key]),
                modules=tuple(graph.first_fqn[m] for m in graph.post_order if nearest_unit[m] == key)[::-1],
                reason=reason,
            )
        )
    return units


def _check_claims(
    graph: ModuleGraph,
    infos: dict[int, ParamInfo],
    resolved: dict[int, tuple[_Resolved, _Resolved]],
    chosen: dict[int, torch.dtype],
    claims: dict[int, int],
) -> int | None:
    """Simulate FSDP2's claim-by-reachability; return a shared module to force as a unit, if any.

    FSDP2's ``fully_shard`` claims every parameter reachable from its module that no earlier
    call claimed. A unit that reaches a parameter it does not dominate (through a shared module)
    would claim it for the wrong forward, so such a shared module must be a unit itself.
    """
    for key, owner in claims.items():
        info = infos[key]
        expected = next(a for a in graph.dom_ancestors(info.home) if a in chosen)
        if owner == expected:
            continue
        if len(info.holders) > 1:
            raise PrecisionError(
                f"tied parameter {info.fqn} (also {', '.join(info.aliases[1:])}) would be claimed by unit "
                f"{unit_label(graph.first_fqn[owner])!r}, which does not enclose all its uses; FSDP2 needs a tied "
                "parameter in a unit that encloses every module using it. Remove that unit from wrap= or untie."
            )
        for anc in graph.dom_ancestors(info.holders[0]):
            if len(graph.parents.get(anc, [])) > 1:
                return anc
        raise PrecisionError(  # pragma: no cover - defensive
            f"parameter {info.fqn} would be claimed by unit {unit_label(graph.first_fqn[owner])!r} instead of "
            f"{unit_label(graph.first_fqn[expected])!r}; please report this model"
        )
    for key, (g, _) in resolved.items():
        if chosen[claims[key]] != g.dtype:  # pragma: no cover - the solver guarantees this
            raise PrecisionError(f"internal: parameter {infos[key].fqn} planned at {g.dtype} but its unit gathers {chosen[claims[key]]}")
    return None
