"""Which wrap unit owns a module or parameter seen in a graph, and what the plan says of it.

A graph compiled from the whole model names modules from the root (``model.layers.3.mlp``); a
graph compiled per block (``layer.compile(...)`` inside FSDP2) names them from the block
(``mlp``). Lookups therefore accept a relative FQN and resolve it by suffix, when the suffix is
unambiguous (or every candidate agrees).

    UnitIndex
    ├── units: fqn -> gather dtype          (from a PrecisionPlan, from FSDP2 states, or root only)
    └── params: fqn -> ParamPlan             (only with a plan)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fx_precision.plan import ParamPlan, PrecisionPlan


@dataclass
class UnitIndex:
    units: dict[str, torch.dtype | None] = field(default_factory=lambda: {"": None})
    params: dict[str, ParamPlan] = field(default_factory=dict)
    module_unit: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, plan: PrecisionPlan) -> UnitIndex:
        params = {alias: p for p in plan.params.values() for alias in p.aliases}
        module_unit = {m: u.fqn for u in plan.units for m in u.modules}
        return cls({u.fqn: u.gather for u in plan.units}, params, module_unit)

    @classmethod
    def from_units(cls, units: dict[str, torch.dtype | None]) -> UnitIndex:
        return cls(dict(units) or {"": None})

    # -- resolution ------------------------------------------------------------------------------
    def _resolve(self, fqn: str, names: list[str]) -> str | None:
        if fqn in names:
            return fqn
        if not fqn:
            return None
        lowered = fqn.lower()
        hits = [n for n in names if n.lower() == lowered or n.lower().endswith("." + lowered)]
        return hits[0] if len(hits) == 1 else None

    def param(self, fqn: str) -> ParamPlan | None:
        """The plan of a parameter, by exact, case-insensitive or unambiguous-suffix FQN."""
        name = self._resolve(fqn, list(self.params))
        if name is not None:
            return self.params[name]
        if not fqn or not self.params:
            return None
        lowered = fqn.lower()
        hits = [p for n, p in self.params.items() if n.lower().endswith("." + lowered) or n.lower() == lowered]
        if hits and all((p.gather, p.master) == (hits[0].gather, hits[0].master) for p in hits):
            return hits[0]  # e.g. "mlp.up_proj.weight" in a per-layer graph: every layer agrees
        return None

    def unit_of_module(self, fqn: str) -> str | None:
        if self.module_unit:
            name = self._resolve(fqn, list(self.module_unit))
            if name is not None:
                return self.module_unit[name]
        best = None
        for unit in self.units:
            if unit == "" or fqn == unit or fqn.startswith(unit + "."):
                if best is None or len(unit) > len(best):
                    best = unit
        return best

    def unit_of_param(self, fqn: str) -> str | None:
        planned = self.param(fqn)
        if planned is not None:
            return planned.unit
        owner = fqn.rpartition(".")[0]
        return self.unit_of_module(owner)
