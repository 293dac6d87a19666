"""Lowering: ``compile_precision`` turns a spec and a model into a ``PrecisionPlan``.

    model ─ ModuleGraph (dominators, parameter homes) ─┐
    spec ─ selection.resolve_params (dtype per parameter) ─ unit_solver.solve_units ─▶ PrecisionPlan

Semantics (DESIGN.md, "Plan semantics"):

* every floating parameter folds the rules that select it, in order; last match wins per axis;
  axes no rule sets take the run defaults (``default_gather``; ``default_master`` or, when that
  is ``None``, the parameter's current dtype);
* units = the root (always at ``default_gather``) + the modules ``wrap`` names + the fewest
  precision units, each as high in the tree as its parameters allow, + a group unit per tied
  parameter gathered off the default; every parameter gathers at the dtype of the unit that claims it;
* compiling never modifies the model.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from fx_precision.dtypes import axis_dtype
from fx_precision.module_graph import ModuleGraph, ParamInfo, collect_params
from fx_precision.plan import ParamPlan, PrecisionPlan
from fx_precision.selection import resolve_params, selected_aliases
from fx_precision.spec import PrecisionSpec
from fx_precision.unit_solver import solve_units


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Lowering allocates many small, acyclic records; with the model's tens of thousands of objects
    alive, each automatic collection re-traverses them all (about 40 % of the time at 12k modules)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
    direct parameters need two gather dtypes, a gather rule hits a buffer, tied aliases get two
    explicit dtypes, or the root's own parameters need a non-default gather dtype.
    """
    with _gc_paused():
        return _lower(model, spec or PrecisionSpec(), default_gather, default_master, wrap)


def _lower(
    model: nn.Module,
    spec: PrecisionSpec,
    default_gather: torch.dtype | str,
    default_master: torch.dtype | str | None,
    wrap: Sequence[str],
) -> PrecisionPlan:
    default_gather = axis_dtype(default_gather, "default_gather")
    default_master = axis_dtype(default_master, "default_master") if default_master is not None else None
    graph = ModuleGraph.of(model)
    infos = collect_params(graph)
    aliases: dict[str, ParamInfo] = {alias: info for info in infos.values() for alias in info.aliases}
    module_paths = graph.module_paths()
    buffers = graph.buffer_names()
    floating = {alias for alias, info in aliases.items() if info.param.is_floating_point()}
    selected = [(rule, selected_aliases(rule, module_paths, aliases, buffers, floating)) for rule in spec.rules]
    resolved = resolve_params(infos, selected, default_gather, default_master)
    solution = solve_units(graph, infos, resolved, default_gather=default_gather, module_paths=module_paths, wrap=wrap)
    params = {
        infos[key].fqn: ParamPlan(
            fqn=infos[key].fqn,
            aliases=tuple(infos[key].aliases),
            numel=infos[key].param.numel(),
            gather=g.dtype,
            master=m.dtype,
            gather_rule=g.rule,
            master_rule=m.rule,
            unit=solution.unit_of[key],
        )
        for key, (g, m) in resolved.items()
    }
    return PrecisionPlan(
        params=params,
        units=tuple(solution.units),
        default_gather=default_gather,
        default_master=default_master,
        spec_text=spec.text(),
        wrap=tuple(wrap),
    )
