"""The plan: one gather and one master dtype per parameter, and the FSDP2 units that express them.

For tiny Qwen3.5 with ``*embed_tokens=bf16``, ``default_gather=fp32`` and
``wrap=("model.layers.*",)`` the plan is::

    <root>  Qwen3_5ForCausalLM      unit (root)       gather fp32   lm_head, model.norm
    ├── model.embed_tokens          unit (precision)  gather bf16   <- *embed_tokens=bf16
    ├── model.layers.0              unit (wrap)       gather fp32
    ├── ...
    └── model.layers.3              unit (wrap)       gather fp32

    apply order: model.embed_tokens, model.layers.0 … model.layers.3, <root>   (inner first)

With the embedding tied to ``lm_head`` the embedding unit is a *group*: ``model.embed_tokens+lm_head``,
one ``fully_shard([embed_tokens, lm_head])``.

This module holds the data, its table, its JSON and the one consistency check
(``check_plan_matches``). It is made by ``lowering.compile_precision``: rules to per-parameter
dtypes (``selection``), then the fewest units (``unit_solver``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from fx_precision.dtypes import AXIS_DTYPES, dtype_name, parse_dtype
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import module_label
from fx_precision.text_enum import TextEnum


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


class UnitKind(TextEnum):
    """Why a module is an FSDP2 unit."""

    ROOT = "root"  # the model: everything no other unit holds, applied last
    WRAP = "wrap"  # asked for by ``wrap=`` (one unit per layer, say)
    PRECISION = "precision"  # needed by the spec: its parameters gather at another dtype than around it
    GROUP = "group"  # modules sharing a tied parameter, sharded together by one ``fully_shard([m1, m2])``


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
    kind: UnitKind
    gather: torch.dtype
    params: tuple[str, ...]
    modules: tuple[str, ...]
    reason: str
    group: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How tables name the unit: ``<root>``, a module FQN, or ``a+b`` for a group unit."""
        return "+".join(self.group) if self.group else module_label(self.fqn)


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
        raise PrecisionError(f"{module_label(fqn)!r} is not a unit of this plan; units: {[module_label(u.fqn) for u in self.units]}")

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
        """Load a plan and check it against ``model`` (``check_plan_matches``); any malformed or
        inconsistent input raises ``PrecisionError`` naming the field."""
        try:
            data = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as exc:
            raise PrecisionError(f"plan JSON does not parse ({exc}); save plans with PrecisionPlan.to_json()") from None
        if not isinstance(data, dict):
            raise PrecisionError(f"plan JSON must be an object, got {type(data).__name__}; save plans with PrecisionPlan.to_json()")
        if data.get("version") != 1:
            raise PrecisionError(
                f"plan JSON version {data.get('version')!r} is not supported (expected 1); recompile the plan and save it with to_json()"
            )
        try:
            params = {
                fqn: ParamPlan(
                    fqn=fqn,
                    aliases=tuple(p["aliases"]),
                    numel=int(p["numel"]),
                    gather=_axis_dtype(p["gather"], f"params.{fqn}.gather"),
                    master=_axis_dtype(p["master"], f"params.{fqn}.master"),
                    gather_rule=p.get("gather_rule"),
                    master_rule=p.get("master_rule"),
                    unit=str(p["unit"]),
                )
                for fqn, p in data["params"].items()
            }
            units = tuple(
                UnitPlan(
                    fqn=str(u["fqn"]),
                    kind=_unit_kind(u["kind"], f"units[{i}].kind"),
                    gather=_axis_dtype(u["gather"], f"units[{i}].gather"),
                    params=tuple(u["params"]),
                    modules=tuple(u["modules"]),
                    reason=str(u.get("rule", "")),
                    group=tuple(u.get("group", ())),
                )
                for i, u in enumerate(data["units"])
            )
            dm = data.get("default_master")
            plan = cls(
                params=params,
                units=units,
                default_gather=_axis_dtype(data["default_gather"], "default_gather"),
                default_master=_axis_dtype(dm, "default_master") if dm else None,
                spec_text=str(data.get("spec", "")),
                wrap=tuple(data.get("wrap", ())),
            )
        except KeyError as exc:
            raise PrecisionError(f"plan JSON lacks the field {exc}; save plans with PrecisionPlan.to_json()") from None
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, PrecisionError):
                raise
            raise PrecisionError(f"plan JSON has a field of the wrong type ({exc}); save plans with PrecisionPlan.to_json()") from None
        check_plan_matches(plan, model)
        return plan


def _axis_dtype(name: Any, where: str) -> torch.dtype:
    dtype = parse_dtype(str(name), what=f"plan JSON {where}")
    if dtype not in AXIS_DTYPES:
        raise PrecisionError(f"plan JSON {where}: {dtype_name(dtype)} is not a precision dtype; use one of fp32, bf16, fp16")
    return dtype


UNIT_KINDS = tuple(k.value for k in UnitKind)


def _unit_kind(name: object, where: str) -> UnitKind:
    try:
        return UnitKind(str(name))
    except ValueError:
        raise PrecisionError(f"plan JSON {where}: unknown kind {name!r}; kinds: {', '.join(UNIT_KINDS)}") from None


def check_plan_matches(plan: PrecisionPlan, model: nn.Module) -> None:
    """The one check that a plan belongs to ``model`` and is consistent; raises ``PrecisionError``.

    Every floating parameter of the model is planned (and nothing else), at its size; every unit
    names modules of the model, once, with a known kind; exactly one root unit, applied last;
    every parameter gathers at its unit's dtype. Used by ``from_json``, ``apply_fsdp2``, ``lint``
    and the backend.
    """
    model_params = {fqn: p for fqn, p in model.named_parameters() if p.is_floating_point()}
    missing = sorted(set(model_params) - set(plan.params))
    extra = sorted(set(plan.params) - set(model_params))
    if missing or extra:
        raise PrecisionError(
            f"the plan does not match this model: parameters not planned {missing[:5]}, planned but not in the model "
            f"{extra[:5]}; recompile the plan for this model with compile_precision"
        )
    for fqn, p in plan.params.items():
        if model_params[fqn].numel() != p.numel:
            raise PrecisionError(
                f"the plan does not match this model: {fqn} has {model_params[fqn].numel()} elements, the plan says {p.numel}; "
                "recompile the plan for this model"
            )
    modules = {fqn for fqn, _ in model.named_modules()}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for unit in plan.units:
        if unit.gather not in AXIS_DTYPES:
            raise PrecisionError(f"plan unit {unit.label!r} gathers at {dtype_name(unit.gather)}; precision axes take fp32, bf16, fp16")
        if unit.kind not in UNIT_KINDS:
            raise PrecisionError(f"plan unit {unit.label!r} has unknown kind {unit.kind!r}; kinds: {', '.join(UNIT_KINDS)}")
        if (unit.fqn, unit.group) in seen:
            raise PrecisionError(f"plan unit {unit.label!r} appears twice; FSDP2 shards a module once. Recompile the plan")
        seen.add((unit.fqn, unit.group))
        for fqn in unit.group or (unit.fqn,):
            if fqn not in modules:
                raise PrecisionError(f"plan unit {unit.label!r}: {module_label(fqn)!r} is not a module of this model; recompile the plan")
    roots = [u for u in plan.units if u.kind == UnitKind.ROOT]
    if len(roots) != 1 or roots[0].fqn != "" or plan.units[-1] is not roots[0]:
        raise PrecisionError(
            "the plan needs exactly one root unit (fqn '', applied last), or the modules outside every unit stay unsharded; "
            "recompile the plan with compile_precision"
        )
    gathers = {u.fqn: u.gather for u in plan.units}
    for p in plan.params.values():
        if p.gather not in AXIS_DTYPES or p.master not in AXIS_DTYPES:
            raise PrecisionError(
                f"plan parameter {p.fqn}: gather {dtype_name(p.gather)}, master {dtype_name(p.master)}; "
                "precision axes take fp32, bf16, fp16"
            )
        if p.unit not in gathers:
            raise PrecisionError(f"plan parameter {p.fqn} is claimed by {module_label(p.unit)!r}, which is not a unit of the plan")
        if gathers[p.unit] != p.gather:
            raise PrecisionError(
                f"plan parameter {p.fqn} gathers at {dtype_name(p.gather)} but its unit {module_label(p.unit)!r} gathers at "
                f"{dtype_name(gathers[p.unit])}; one unit gathers at one dtype. Recompile the plan"
            )


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
