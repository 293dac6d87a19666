"""Selection: rules to one (gather, master) dtype per parameter object.

    PrecisionSpec rules, in order          parameter objects (aliases: tied names of one object)
    *embed_tokens=bf16      ──selects──▶   model.embed_tokens.weight  (also lm_head.weight)
    param:*.A_log=master:fp32 ─selects─▶   model.layers.0.linear_attn.A_log, ...

Each alias folds the rules that select it, last match wins per axis; an explicit rule on one alias
of a tied object wins over the run default on another; two explicit rules that disagree raise. A
rule that selects nothing raises, suggesting the nearest names.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import ParamInfo, module_label
from fx_precision.spec import DEFAULT, AxisDtype, ParamSel, Rule, glob_matcher


def suggest(pattern: str, names: Iterable[str], n: int = 3) -> list[str]:
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
    hint = suggest(pattern, names)
    nearest = f"; nearest {kind}: {', '.join(hint)}" if hint else ""
    return PrecisionError(f"rule {rule.text()!r} selects no {what}{nearest}. Fix the glob or drop the rule.")


@dataclass(frozen=True)
class Resolved:
    """One axis of one parameter: its dtype and the rule that decided it (None: the run default)."""

    dtype: torch.dtype
    rule: str | None


class _AxisTable:
    """One axis of every alias the rules touch: the last rule (in order) that sets it wins. Resolved
    values are shared (they are frozen), so a model's 16k parameters make a handful of objects."""

    def __init__(self, rules: Sequence[tuple[Rule, set[str]]], axis: str) -> None:
        self.hits: dict[str, tuple[AxisDtype, str]] = {}
        for rule, selected in rules:
            value: AxisDtype | None = getattr(rule, axis)
            if value is None:
                continue
            decided = (value, rule.text())
            for alias in selected:
                self.hits[alias] = decided
        self.made: dict[tuple[torch.dtype, str | None], Resolved] = {}

    def resolve(self, alias: str, default: torch.dtype) -> Resolved:
        value, rule = self.hits.get(alias, (DEFAULT, None))
        dtype = value if isinstance(value, torch.dtype) else default
        made = self.made.get((dtype, rule))
        if made is None:
            made = self.made[(dtype, rule)] = Resolved(dtype, rule)
        return made


def selected_aliases(
    rule: Rule,
    module_paths: list[tuple[str, nn.Module]],
    param_aliases: dict[str, ParamInfo],
    buffers: list[str],
    floating: set[str] | None = None,
) -> set[str]:
    """The parameter FQNs (all aliases, floating only: ``floating`` where the caller has them) a rule
    selects; raises on zero hits."""
    sel = rule.select
    if floating is None:
        floating = {a for a, info in param_aliases.items() if info.param.is_floating_point()}
    if isinstance(sel, ParamSel):
        glob = glob_matcher(sel.fqn)
        hits = {a for a in param_aliases if glob(a) is not None}
        buffer_hits = [b for b in buffers if glob(b) is not None]
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
    match = sel.matcher()
    matched = [path for path, mod in module_paths if match(path, mod)]
    if not matched:
        by_fqn = [(p, m) for p, m in module_paths if sel.fqn is None or fnmatch.fnmatchcase(p, sel.fqn)]
        if not by_fqn:
            raise _zero_hit(rule, "module", sel.fqn or "", (p for p, _ in module_paths if p), "modules")
        assert sel.cls is not None  # the FQN glob matched, so the class glob is what failed
        raise _zero_hit(rule, "module class", sel.cls, {type(m).__name__ for _, m in by_fqn}, "classes")
    prefixes = set(matched)
    hits = set()
    everything = "" in prefixes
    for alias in floating:
        owner = alias.rpartition(".")[0]
        while owner and owner not in prefixes:  # the alias's owning module or one above it is selected
            owner = owner.rpartition(".")[0]
        if owner or everything:
            hits.add(alias)
    if not hits:
        raise PrecisionError(
            f"rule {rule.text()!r} selects module(s) {', '.join(module_label(m) for m in matched[:3])} but they hold no "
            "floating parameter; point it at a module with parameters or drop it."
        )
    return hits


def resolve_params(
    infos: dict[int, ParamInfo],
    selected: list[tuple[Rule, set[str]]],
    default_gather: torch.dtype,
    default_master: torch.dtype | None,
) -> dict[int, tuple[Resolved, Resolved]]:
    """(gather, master) per floating parameter, folded per alias; tied aliases must agree."""
    resolved: dict[int, tuple[Resolved, Resolved]] = {}
    gather, master = _AxisTable(selected, "gather"), _AxisTable(selected, "master")
    for key, info in infos.items():
        if not info.param.is_floating_point():
            continue
        master_default = default_master or info.param.dtype
        if len(info.aliases) == 1:  # the common case: no tie, nothing to merge
            alias = info.aliases[0]
            resolved[key] = (gather.resolve(alias, default_gather), master.resolve(alias, master_default))
            continue
        per_alias = [(alias, gather.resolve(alias, default_gather), master.resolve(alias, master_default)) for alias in info.aliases]
        g0 = _merge_aliases(info, [(alias, g) for alias, g, _ in per_alias], "gather")
        m0 = _merge_aliases(info, [(alias, m) for alias, _, m in per_alias], "master")
        resolved[key] = (g0, m0)
    return resolved


def _merge_aliases(info: ParamInfo, per_alias: list[tuple[str, Resolved]], axis: str) -> Resolved:
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
