"""The unit solver: the fewest FSDP2 units that express every parameter's gather dtype.

    dominator tree of the module graph            units (apply order: inner first)
    <root>        {fp32}                          model.embed_tokens  precision  bf16
    ├── model.embed_tokens  {bf16}  ──────────▶   model.layers.0..N   wrap       fp32
    ├── model.layers.0..N   {fp32}  [wrap]        <root>              root       fp32
    └── lm_head             {fp32}

A DP over (module, enclosing dtype) picks the fewest precision units, each as high as its
parameters allow; forced units (the root, ``wrap`` globs) cost nothing. FSDP2 claims parameters by
reachability, so the result is checked by simulating those claims: a shared module that a wrapped
parent would claim becomes a unit of its own. A tied parameter off the default gather becomes a
group unit of every module holding it. Everything is linear in modules (the DP memo is module x
dtype; the tree walks are single passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import ModuleGraph, ParamInfo, module_label
from fx_precision.plan import UnitKind, UnitPlan
from fx_precision.selection import Resolved, suggest
from fx_precision.spec import glob_matcher

Resolution = dict[int, tuple[Resolved, Resolved]]


@dataclass
class Solution:
    """The units in apply order, and the unit (FQN; a group: its first module) claiming each parameter."""

    units: list[UnitPlan]
    unit_of: dict[int, str]


def solve_units(
    graph: ModuleGraph,
    infos: dict[int, ParamInfo],
    resolved: Resolution,
    *,
    default_gather: torch.dtype,
    module_paths: list[tuple[str, nn.Module]],
    wrap: Sequence[str],
) -> Solution:
    """Units for ``resolved`` (parameter key -> (gather, master)); raises where none can express it."""
    grouped = _group_units(graph, infos, resolved, default_gather)
    solved = {key: r for key, r in resolved.items() if key not in grouped.claims}
    direct = _direct_gathers(graph, infos, solved, default_gather)
    forced = _forced_units(graph, module_paths, wrap)
    candidates = sorted({default_gather} | {g.dtype for g, _ in solved.values()}, key=lambda d: (d != default_gather, str(d)))

    extra_forced: set[int] = set()
    while True:  # solve; force a shared module into a unit if FSDP2 would claim its weights wrongly
        chosen = _UnitSolver(graph, direct, set(forced) | extra_forced, candidates, default_gather).units()
        order = [key for key in graph.post_order if key in chosen]
        claims = _simulate_claims(graph, order, solved)
        nearest = graph.nearest(chosen)
        fix = _check_claims(graph, infos, solved, chosen, claims, nearest)
        if fix is None:
            break
        if fix in extra_forced or fix in forced:  # pragma: no cover - defensive: no progress possible
            raise PrecisionError(f"cannot place module {graph.first_fqn[fix]!r} in a unit; please report this model")
        extra_forced.add(fix)

    rules = {key: g.rule for key, (g, _) in solved.items()}
    units = _assemble_units(graph, order, chosen, claims, infos, rules, forced, extra_forced, default_gather, nearest)
    unit_of = {key: graph.first_fqn[owner] for key, owner in claims.items()}
    unit_of.update({key: unit.fqn for key, unit in grouped.claims.items()})
    return Solution(_insert_groups(graph, units, grouped.units), unit_of)


@dataclass
class _Choice:
    cost: int
    unit_dtype: torch.dtype | None  # None: not a unit
    tiebreak: tuple[int, ...]


@dataclass(frozen=True)
class _Shape:
    """What the DP sees of a dominator subtree; subtrees of one shape (the N layers of a model) are solved once."""

    own: frozenset[torch.dtype]  # gather dtypes of the parameters homed at the node
    forced: bool  # the root or a wrap unit
    is_root: bool
    kids: tuple[tuple[int, int], ...]  # (shape of a dominator child, how many children have it), sorted
    subtree: frozenset[torch.dtype]  # gather dtypes anywhere in the subtree
    forced_below: bool  # a forced unit strictly inside the subtree

    @property
    def free(self) -> frozenset[torch.dtype] | None:
        """The subtree's dtypes where it needs no unit of its own (None: it holds a forced unit)."""
        return None if self.forced or self.forced_below else self.subtree


class _UnitSolver:
    """Fewest precision units over the dominator tree (a DP over subtree shape x enclosing dtype).

    ``solve(s, d)`` = fewest precision units in a dominator subtree of shape ``s`` when its nearest
    enclosing unit gathers at ``d``. Forced units (root, ``wrap``) cost nothing; on a tie a unit higher
    up beats units further down, so a subtree that needs one other dtype becomes one unit. Subtrees are
    hash-consed into shapes bottom-up (own dtypes, forced, children's shapes with counts): a model's
    repeated layers are one shape, so the DP's work follows the distinct shapes, and only the final walk
    (``units``) visits every module.
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
        self.candidates = candidates
        self.default_gather = default_gather
        self.memo: dict[tuple[int, torch.dtype], _Choice] = {}
        self.shapes: list[_Shape] = []
        self.shape_of: dict[int, int] = {}  # module key -> shape index
        interned: dict[tuple[object, ...], int] = {}
        root = id(graph.root)
        no_dtypes: frozenset[torch.dtype] = frozenset()
        for key in self._dom_post_order():
            counts: dict[int, int] = {}
            for kid in graph.dom_children[key]:
                shape = self.shape_of[kid]
                counts[shape] = counts.get(shape, 0) + 1
            own = frozenset(direct[key]) if key in direct else no_dtypes
            signature = (own, key in forced, key == root, tuple(sorted(counts.items())))
            index = interned.get(signature)
            if index is None:
                index = interned[signature] = len(self.shapes)
                kid_shapes = [self.shapes[k] for k in counts]
                self.shapes.append(
                    _Shape(
                        own=own,
                        forced=key in forced,
                        is_root=key == root,
                        kids=signature[3],
                        subtree=own.union(*(k.subtree for k in kid_shapes)),
                        forced_below=any(k.forced or k.forced_below for k in kid_shapes),
                    )
                )
            self.shape_of[key] = index

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

    def _children_cost(self, shape: _Shape, d: torch.dtype) -> int:
        """Fewest units in the subtrees of the dominator children under a unit at ``d``."""
        cost = 0
        for kid, count in shape.kids:
            needs = self.shapes[kid].free
            if needs is not None and (not needs or (len(needs) == 1 and d in needs)):
                continue  # solve(kid, d) would cost 0 (its first case), without the call
            cost += count * self.solve(kid, d).cost
        return cost

    def solve(self, index: int, d: torch.dtype) -> _Choice:
        memo_key = (index, d)
        if memo_key in self.memo:
            return self.memo[memo_key]
        shape = self.shapes[index]
        if not shape.forced and not shape.forced_below and shape.subtree <= {d}:
            choice = _Choice(0, None, (0,))  # nothing below needs another dtype or a unit: no unit, no cost
            self.memo[memo_key] = choice
            return choice
        own = shape.own
        options: list[_Choice] = []
        if not shape.forced and own <= {d}:
            options.append(_Choice(self._children_cost(shape, d), None, (1,)))
        # a unit at a dtype nothing below needs (and not d) never beats one at d: each subtree costs the same
        # under two dtypes it does not need, so those options are skipped, not weighed
        if shape.is_root:
            dtypes = [self.default_gather]
        else:
            dtypes = sorted(own, key=str) if own else [e for e in self.candidates if e == d or e in shape.subtree]
        for e in dtypes:
            unit_cost = 0 if shape.forced else 1
            prefer = (0, 0 if e == d else 1, 0 if e == self.default_gather else 1, self.candidates.index(e))
            options.append(_Choice(unit_cost + self._children_cost(shape, e), e, prefer))
        best = min(options, key=lambda c: (c.cost, c.tiebreak))
        self.memo[memo_key] = best
        return best

    def units(self) -> dict[int, torch.dtype]:
        """Walk the chosen decisions from the root: ``{module key: unit gather dtype}``."""
        chosen: dict[int, torch.dtype] = {}
        shape_of, shapes, dom_children = self.shape_of, self.shapes, self.graph.dom_children
        stack = [(id(self.graph.root), self.default_gather)]
        while stack:
            key, d = stack.pop()
            choice = self.solve(shape_of[key], d)
            inner = d
            if choice.unit_dtype is not None:
                chosen[key] = choice.unit_dtype
                inner = choice.unit_dtype
            for kid in dom_children[key]:
                shape = shapes[shape_of[kid]]
                if shape.forced or shape.forced_below or not shape.subtree <= {inner}:
                    stack.append((kid, inner))
        return chosen


def _direct_gathers(
    graph: ModuleGraph, infos: dict[int, ParamInfo], resolved: dict[int, tuple[Resolved, Resolved]], default_gather: torch.dtype
) -> dict[int, set[torch.dtype]]:
    """Gather dtypes of the parameters homed at each module; raises where no unit can express them."""
    home_params: dict[int, list[int]] = {}
    for key in resolved:
        home_params.setdefault(infos[key].home, []).append(key)
    direct = {home: {resolved[k][0].dtype for k in keys} for home, keys in home_params.items()}
    for home, dtypes in direct.items():
        if len(dtypes) > 1:
            names = [f"{infos[k].fqn}={dtype_name(resolved[k][0].dtype)}" for k in home_params[home]]
            raise PrecisionError(
                f"module {module_label(graph.first_fqn[home])!r} holds parameters that need different gather dtypes "
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
    graph: ModuleGraph, infos: dict[int, ParamInfo], resolved: dict[int, tuple[Resolved, Resolved]], default_gather: torch.dtype
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
            kind=UnitKind.GROUP,
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
                if other.kind is not UnitKind.GROUP and other.fqn == member:
                    raise PrecisionError(
                        f"module {member!r} is both a unit of its own ({other.reason}) and part of the tied group {unit.label}; "
                        "drop it from wrap= or untie the weights"
                    )
        holder_paths = [p for h in holders for p in graph.all_paths[h]]

        def contains(u: UnitPlan, paths: list[str] = holder_paths) -> bool:
            return any(u.fqn == "" or p == u.fqn or p.startswith(u.fqn + ".") for p in paths)

        at = next(i for i, u in enumerate(out) if u.kind is not UnitKind.GROUP and contains(u))
        out = [u if u.kind is UnitKind.GROUP else replace(u, modules=tuple(m for m in u.modules if m not in members)) for u in out]
        out.insert(at, unit)
    return out


def _forced_units(graph: ModuleGraph, module_paths: list[tuple[str, nn.Module]], wrap: Sequence[str]) -> dict[int, str]:
    """The root and the outermost matches of each wrap glob ('model.layers.*': each layer, not all below)."""
    if isinstance(wrap, str):
        raise PrecisionError(f"wrap={wrap!r} is a string; pass a list of globs, e.g. wrap=[{wrap!r}]")
    forced: dict[int, str] = {id(graph.root): "root"}
    for glob in wrap:
        match = glob_matcher(glob)
        hits = {path for path, _ in module_paths if path and match(path) is not None}
        if not hits:
            hint = suggest(glob, (p for p, _ in module_paths if p))
            raise PrecisionError(f"wrap glob {glob!r} matches no module{'; nearest: ' + ', '.join(hint) if hint else ''}")
        for path in hits:
            parts = path.split(".")
            if not any(".".join(parts[:i]) in hits for i in range(1, len(parts))):  # no matched ancestor: outermost
                forced.setdefault(id(graph.module_at(path)), f"wrap {glob}")
    return forced


def _assemble_units(
    graph: ModuleGraph,
    order: list[int],
    chosen: dict[int, torch.dtype],
    claims: dict[int, int],
    infos: dict[int, ParamInfo],
    rules: dict[int, str | None],
    forced: dict[int, str],
    extra_forced: set[int],
    default_gather: torch.dtype,
    nearest_unit: dict[int, int],
) -> list[UnitPlan]:
    members: dict[int, list[str]] = {k: [] for k in chosen}
    for key in reversed(graph.post_order):  # dominators before what they dominate
        members[nearest_unit[key]].append(graph.first_fqn[key])
    unit_params: dict[int, list[int]] = {k: [] for k in chosen}
    for key, owner in claims.items():
        unit_params[owner].append(key)
    units = []
    for key in order:
        kind = UnitKind.ROOT if key == id(graph.root) else (UnitKind.WRAP if key in forced else UnitKind.PRECISION)
        if kind is UnitKind.ROOT:
            reason = f"default_gather={dtype_name(default_gather)}"
        elif key in extra_forced:
            reason = "shared module (several parents)"
        else:
            deciding = sorted({rules[p] or "default" for p in unit_params[key]})
            reason = ", ".join(deciding) if deciding else "(no parameters)"
            if kind is UnitKind.WRAP:
                reason = f"{forced[key]}; {reason}"
        units.append(
            UnitPlan(
                fqn=graph.first_fqn[key],
                kind=kind,
                gather=chosen[key],
                params=tuple(infos[p].fqn for p in unit_params[key]),
                modules=tuple(members[key]),
                reason=reason,
            )
        )
    return units


def _simulate_claims(graph: ModuleGraph, order: list[int], solved: Resolution) -> dict[int, int]:
    """FSDP2's rule: each ``fully_shard``, in order, claims every parameter reachable from its module
    that no earlier one claimed. A walk stops at a unit already applied (all it reaches is claimed),
    so the whole simulation visits each module about once."""
    claims: dict[int, int] = {}
    applied: set[int] = set()
    for unit_key in order:
        stack, seen = [unit_key], set()
        while stack:
            key = stack.pop()
            if key in seen:
                continue
            seen.add(key)
            for param in graph.modules[key]._parameters.values():
                if param is not None and id(param) in solved:
                    claims.setdefault(id(param), unit_key)
            stack.extend(kid for kid in reversed(graph.children[key]) if kid not in applied)  # pre-order, as named_parameters
        applied.add(unit_key)
    return claims


def _check_claims(
    graph: ModuleGraph,
    infos: dict[int, ParamInfo],
    resolved: dict[int, tuple[Resolved, Resolved]],
    chosen: dict[int, torch.dtype],
    claims: dict[int, int],
    nearest: dict[int, int],
) -> int | None:
    """Simulate FSDP2's claim-by-reachability; return a shared module to force as a unit, if any.

    FSDP2's ``fully_shard`` claims every parameter reachable from its module that no earlier
    call claimed. A unit that reaches a parameter it does not dominate (through a shared module)
    would claim it for the wrong forward, so such a shared module must be a unit itself.
    """
    for key, owner in claims.items():
        info = infos[key]
        expected = nearest[info.home]
        if owner == expected:
            continue
        if len(info.holders) > 1:
            raise PrecisionError(
                f"tied parameter {info.fqn} (also {', '.join(info.aliases[1:])}) would be claimed by unit "
                f"{module_label(graph.first_fqn[owner])!r}, which does not enclose all its uses; FSDP2 needs a tied "
                "parameter in a unit that encloses every module using it. Remove that unit from wrap= or untie."
            )
        for anc in graph.dom_ancestors(info.holders[0]):
            if len(graph.parents.get(anc, [])) > 1:
                return anc
        raise PrecisionError(  # pragma: no cover - defensive
            f"parameter {info.fqn} would be claimed by unit {module_label(graph.first_fqn[owner])!r} instead of "
            f"{module_label(graph.first_fqn[expected])!r}; please report this model"
        )
    for key, (g, _) in resolved.items():
        if chosen[claims[key]] != g.dtype:  # pragma: no cover - the solver guarantees this
            raise PrecisionError(f"internal: parameter {infos[key].fqn} planned at {g.dtype} but its unit gathers {chosen[claims[key]]}")
    return None
