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

from collections.abc import Iterable
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
    @staticmethod
    def _matches(fqn: str, names: Iterable[str]) -> list[str]:
        """``fqn`` itself if known; else the names equal to it ignoring case, or ending in ``.fqn``
        (a graph compiled per block names modules from the block: ``mlp`` for ``model.layers.3.mlp``)."""
        names = list(names)
        if fqn in names:
            return [fqn]
        if not fqn:
            return []
        lowered = fqn.lower()
        return [n for n in names if n.lower() == lowered or n.lower().endswith("." + lowered)]

    def param(self, fqn: str) -> ParamPlan | None:
        """The plan of a parameter: by its FQN, or by a suffix whose every match is planned alike
        (``mlp.up_proj.weight`` in a per-layer graph: every layer agrees)."""
        plans = [self.params[name] for name in self._matches(fqn, self.params)]
        if plans and all((p.gather, p.master) == (plans[0].gather, plans[0].master) for p in plans):
            return plans[0]
        return None

    def unit_of_module(self, fqn: str) -> str | None:
        hits = self._matches(fqn, self.module_unit) if self.module_unit else []
        if len(hits) == 1:
            return self.module_unit[hits[0]]
        enclosing = [unit for unit in self.units if unit == "" or fqn == unit or fqn.startswith(unit + ".")]
        return max(enclosing, key=len, default=None)

    def unit_of_param(self, fqn: str) -> str | None:
        planned = self.param(fqn)
        if planned is not None:
            return planned.unit
        owner = fqn.rpartition(".")[0]
        return self.unit_of_module(owner)
