"""Findings from one annotated graph: stable codes, severities, the line to change, the cause chain.

    code     kind               severity                       fires on
    FXP001   uncovered-op       error                          source: op autocast does not cover, wide weight in
                                                               (directly, or input.to(weight.dtype) into grouped_mm)
    FXP002   weight-promotion   error                          source: elementwise op, wide weight x compute activation
    FXP101   explicit-upcast    warn                           a cast/fp32 op the program asked for, leaking to the stream
    FXP102   wide-input         warn (info if contained)       a graph input wider than compute (FSDP2 re-cast, RoPE table)
    FXP201   round-trip-cast    info                           bf16 -> fp32 -> bf16 with nothing between
    FXP202   plan-mismatch      warn                           a parameter seen at a dtype the plan does not predict
    FXP203   wide-gather        info                           a unit gathered wider than compute whose weights only
                                                               feed autocast-covered ops (suggests the rule)
    FXP301   engine-unfollowed  error                          under an engine contract: an op the engine runs with a
                                                               kernel the contract does not follow (rules/engine_coverage.py)

Propagations (type_as, residual adds) are not findings: each source counts the wide nodes and
the wide stream tensors it explains. A source whose wide value never reaches the stream (an fp32
island the program narrows again, as Qwen3.5's gated norm does) is contained and not reported,
except a GEMM that reads its weight at the gather dtype (``grouped_mm`` after ``input.to(weight.dtype)``):
its FLOPs run wide whether or not its output leaves the module.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx

from fx_precision.dtypes import dtype_name
from fx_precision.module_graph import module_label
from fx_precision.passes.graph.annotate import GraphAnnotation, NodeInfo, autocast_covered_uses, is_wide
from fx_precision.passes.graph.kinds import FindingKind, NodeKind, ParamKind, Severity
from fx_precision.passes.graph.nodes import is_cast, node_dtype, node_value, op_name, source_line
from fx_precision.passes.graph.units import UnitIndex
from fx_precision.plan import ParamPlan

CODES = {
    FindingKind.UNCOVERED: "FXP001",
    FindingKind.PROMOTION: "FXP002",
    FindingKind.EXPLICIT_UPCAST: "FXP101",
    FindingKind.WIDE_INPUT: "FXP102",
    FindingKind.ROUND_TRIP: "FXP201",
    FindingKind.PLAN_MISMATCH: "FXP202",
    FindingKind.WIDE_GATHER: "FXP203",
    FindingKind.ENGINE_UNFOLLOWED: "FXP301",
}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: Severity
    kind: FindingKind
    module: str
    unit: str | None
    node: str
    source_line: str | None
    chain: tuple[str, ...]
    message: str
    graph: int = 0
    propagations: int = 0
    stream_tensors: int = 0
    suggestion: str | None = None
    round: int = 0
    masked_by: tuple[str, ...] = ()

    @property
    def is_source(self) -> bool:
        return self.kind.is_source

    @property
    def masked(self) -> bool:
        """Surfaced only after an earlier round's sources were cast (invisible in the graph as traced)."""
        return self.round > 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["severity"] = str(self.severity)
        data["chain"] = list(self.chain)
        data["masked_by"] = list(self.masked_by)
        return data

    def explain(self) -> str:
        """Multi-line text: the finding, where to change it, and how the wide dtype got there."""
        lines = [f"[{self.severity}] {self.code} {self.kind} at {module_label(self.module)} (node {self.node}): {self.message}"]
        if self.masked:
            lines.append(f"  masked (round {self.round}): visible only once {', '.join(self.masked_by) or 'an earlier source'} is fixed")
        if self.source_line:
            lines.append(f"  source: {self.source_line}")
        if self.chain:
            lines.append("  cause chain (latest first):")
            lines.extend(f"    {link}" for link in self.chain)
        if self.suggestion:
            lines.append(f"  fix: {self.suggestion}")
        return "\n".join(lines)


class _Explained:
    """Per origin node: how many propagations it explains and the wide stream tensors it reaches (one pass
    over the graph for all sources, not one per source)."""

    def __init__(self, ann: GraphAnnotation) -> None:
        self.props: dict[str, int] = {}
        self.stream: dict[str, list[NodeInfo]] = {}
        for info in ann.info.values():
            for origin in info.origin:
                if info.kind is NodeKind.PROPAGATION:
                    self.props[origin] = self.props.get(origin, 0) + 1
                if info.stream and info.wide:
                    self.stream.setdefault(origin, []).append(info)

    def __call__(self, origin: str) -> tuple[int, list[NodeInfo]]:
        return self.props.get(origin, 0), self.stream.get(origin, [])


def _chain(ann: GraphAnnotation, info: NodeInfo, stream: list[NodeInfo]) -> tuple[str, ...]:
    latest = stream[-1] if stream else info
    return tuple(link.describe() for link in ann.chain(latest, stop=info.name))


def _input_cause(info: NodeInfo, fsdp_cast_inputs: bool | None) -> str:
    if re.search(r"cos|sin|freq|rope|rotary|position_embeddings", info.name, re.IGNORECASE):
        return "an fp32 table such as RoPE cos/sin (intended; reported, never cast)"
    if fsdp_cast_inputs:
        return "FSDP2 cast_forward_inputs=True re-cast this unit's inputs to its gather dtype; under autocast set cast_forward_inputs=False"
    return (
        "a tensor made outside this graph: a module run eagerly before this compiled block (an embedding, a norm) emitted it "
        "wide; fxp.eager_casts(model, ...) / fxp.apply_eager_fix(policy, model, ...) derives the hook that narrows it where it is "
        "made (under FSDP2 with cast_forward_inputs=True, the unit's boundary re-cast does the same: set it False under autocast)"
    )


def graph_findings(
    ann: GraphAnnotation,
    units: UnitIndex,
    *,
    graph_index: int = 0,
    fsdp_cast_inputs: bool | None = None,
    mismatches: list[tuple[NodeInfo, ParamPlan]] | None = None,
) -> list[Finding]:
    compute = ann.compute
    out: list[Finding] = []
    explained = _Explained(ann)
    for info in ann.info.values():
        if info.kind is NodeKind.SOURCE:
            props, stream = explained(info.name)
            if not stream and info.uncovered_op is None:
                continue  # contained: the program narrows it again before any module boundary (a GEMM at the weight's
                # dtype is reported contained or not: its FLOPs run wide)
            weight = ann.info[info.wide_parent] if info.wide_parent is not None else None
            wname = (weight.param if weight and weight.param else weight.name if weight else "a weight") or "a weight"
            if info.source_kind is FindingKind.UNCOVERED and info.uncovered_op is not None:
                message = (
                    f"{op_name(info.uncovered_op)} is not autocast-covered and needs one dtype; the program casts its input to the "
                    f"weight's dtype ({op_name(info.node)} -> {dtype_name(info.dtype)}), so it reads {wname} at "
                    f"{dtype_name(weight.dtype if weight else None)} and computes at {dtype_name(info.dtype)} in a "
                    f"{dtype_name(compute)} stream"
                )
                rule = f"{_rule_target(info, weight)}={dtype_name(compute)}"
                fix = (
                    f"gather the weight at {dtype_name(compute)} (rule '{rule}'; resolve_policy adds it for stacked MoE experts) or cast "
                    "the weight read (the backend does)"
                )
            elif info.source_kind is FindingKind.UNCOVERED:
                message = (
                    f"{op_name(info.node)} is not autocast-covered; it reads {wname} at {dtype_name(weight.dtype if weight else None)} "
                    f"and emits {dtype_name(info.dtype)} into a {dtype_name(compute)} stream"
                )
                rule = f"{_rule_target(info, weight)}={dtype_name(compute)}"
                fix = f"gather the weight at {dtype_name(compute)} (rule '{rule}') or cast the output"
            else:
                message = (
                    f"{op_name(info.node)} mixes {wname} ({dtype_name(weight.dtype if weight else None)}) with a "
                    f"{dtype_name(compute)} activation; type promotion makes the result {dtype_name(info.dtype)}"
                )
                fix = f"cast the weight or the result to {dtype_name(compute)}, or gather it at {dtype_name(compute)}"
            out.append(
                Finding(
                    code=CODES[info.source_kind or FindingKind.UNCOVERED],
                    severity=Severity.ERROR,
                    kind=info.source_kind or FindingKind.UNCOVERED,
                    module=info.module,
                    unit=info.unit,
                    node=info.name,
                    source_line=info.line,
                    chain=_chain(ann, info, stream),
                    message=message + f"; explains {props} propagated node(s), {len(stream)} wide stream tensor(s)",
                    graph=graph_index,
                    propagations=props,
                    stream_tensors=len(stream),
                    suggestion=fix,
                )
            )
        elif info.kind is NodeKind.INTENTIONAL:
            props, stream = explained(info.name)
            if stream:
                out.append(
                    Finding(
                        code=CODES[FindingKind.EXPLICIT_UPCAST],
                        severity=Severity.WARN,
                        kind=FindingKind.EXPLICIT_UPCAST,
                        module=info.module,
                        unit=info.unit,
                        node=info.name,
                        source_line=info.line,
                        chain=_chain(ann, info, stream),
                        message=f"{op_name(info.node)} produces {dtype_name(info.dtype)} as the program asked, and it leaks into "
                        f"the stream ({len(stream)} wide stream tensor(s), first at {module_label(stream[0].module)})",
                        graph=graph_index,
                        propagations=props,
                        stream_tensors=len(stream),
                        suggestion="if the wide stream is intended, keep it (the backend never narrows it); "
                        f"otherwise cast back to {dtype_name(compute)} before the module returns",
                    )
                )
        elif info.kind is NodeKind.INPUT and info.wide:
            props, stream = explained(info.name)
            leaks = [s for s in stream if s.node is not info.node]
            out.append(
                Finding(
                    code=CODES[FindingKind.WIDE_INPUT],
                    severity=Severity.WARN if leaks else Severity.INFO,
                    kind=FindingKind.WIDE_INPUT,
                    module=info.module,
                    unit=info.unit,
                    node=info.name,
                    source_line=info.line,
                    chain=_chain(ann, info, leaks),
                    message=f"graph input {info.name} arrives {dtype_name(info.dtype)} (compute {dtype_name(compute)}); likely cause: "
                    f"{_input_cause(info, fsdp_cast_inputs)}",
                    graph=graph_index,
                    propagations=props,
                    stream_tensors=len(leaks),
                )
            )
    out.extend(_round_trips(ann, graph_index))
    out.extend(_plan_mismatches(mismatches or [], graph_index))
    out.extend(_wide_gathers(ann, units, graph_index))
    return out


def _plan_mismatches(mismatches: list[tuple[NodeInfo, ParamPlan]], graph_index: int) -> list[Finding]:
    """FXP202: one finding per parameter, or one per cause when several parameters share it (a model
    built or loaded at another dtype than its plan's masters mismatches every parameter alike)."""
    groups: dict[tuple[torch.dtype | None, torch.dtype, torch.dtype], list[NodeInfo]] = {}
    for info, planned in mismatches:
        groups.setdefault((info.dtype, planned.gather, planned.master), []).append(info)
    out = []
    for (seen, gather, master), infos in groups.items():
        first = infos[0]
        if len(infos) == 1:
            message = f"parameter {first.param} is seen at {dtype_name(seen)}, the plan gathers it at {dtype_name(gather)}"
            fix = "apply the same plan with apply_fsdp2, or recompile the plan for this model"
        else:
            names = ", ".join(str(i.param) for i in infos[:3]) + (f" and {len(infos) - 3} more" if len(infos) > 3 else "")
            message = (
                f"{len(infos)} parameters ({names}) are seen at {dtype_name(seen)}; the plan holds them as {dtype_name(master)} "
                f"masters gathered at {dtype_name(gather)}: the model was built or loaded at {dtype_name(seen)}"
            )
            fix = (
                f"convert the model to its master dtype before analysing it (model.to({master}), or load it with "
                f"dtype={master}), or apply the plan with apply_fsdp2, which does"
            )
        out.append(
            Finding(
                code=CODES[FindingKind.PLAN_MISMATCH],
                severity=Severity.WARN,
                kind=FindingKind.PLAN_MISMATCH,
                module=first.module,
                unit=first.unit,
                node=first.name,
                source_line=first.line,
                chain=(),
                message=message,
                graph=graph_index,
                suggestion=fix,
            )
        )
    return out


def _rule_target(info: NodeInfo, weight: NodeInfo | None) -> str:
    if weight is not None and weight.param:
        owner = weight.param.rpartition(".")[0]
        return f"*{owner.rsplit('.', 1)[-1]}" if owner else f"param:{weight.param}"
    return info.module or "<module>"


def _round_trips(ann: GraphAnnotation, graph_index: int) -> list[Finding]:
    out = []
    for node, info in ann.info.items():
        if not is_cast(node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        middle = node.args[0]
        if not is_cast(middle) or not middle.args or not isinstance(middle.args[0], fx.Node):
            continue
        start = middle.args[0]
        a, b, c = node_dtype(start), node_dtype(middle), info.dtype
        if a is None or b is None or c is None or a != c or not (a.is_floating_point and b.is_floating_point):
            continue
        if a.itemsize >= b.itemsize:  # only narrow -> wide -> narrow is lossless; fp32 -> bf16 -> fp32 rounds
            continue
        chain = (ann.info[start].describe(), ann.info[middle].describe(), info.describe())
        out.append(
            Finding(
                code=CODES[FindingKind.ROUND_TRIP],
                severity=Severity.INFO,
                kind=FindingKind.ROUND_TRIP,
                module=info.module,
                unit=info.unit,
                node=info.name,
                source_line=source_line(node),
                chain=chain,
                message=f"{dtype_name(a)} -> {dtype_name(b)} -> {dtype_name(c)} with no op between: both casts do nothing but move bytes",
                graph=graph_index,
                suggestion="drop both casts",
            )
        )
    return out


def _wide_gathers(ann: GraphAnnotation, units: UnitIndex, graph_index: int) -> list[Finding]:
    compute = ann.compute
    if compute is None:
        return []
    per_unit: dict[str, list[tuple[NodeInfo, bool | None]]] = {}
    for node, info in ann.info.items():
        if info.kind is NodeKind.WEIGHT and info.param_kind is ParamKind.PARAMETER and info.unit is not None:
            uses = autocast_covered_uses(ann, node)
            per_unit.setdefault(info.unit, []).append((info, None if uses == [] else uses is not None))
    out = []
    for unit, weights in per_unit.items():
        gather = units.units.get(unit)
        if gather is None or not is_wide(gather, compute):
            continue  # no known all-gather (no plan, no FSDP2 unit), or already gathered narrow
        used = [(w, covered) for w, covered in weights if covered is not None]
        if not used or not all(covered for _, covered in used) or not all(is_wide(w.dtype, compute) for w, _ in used):
            continue
        target = module_label(unit)
        rule = f"{unit}={dtype_name(compute)}" if unit else f"default_gather={dtype_name(compute)} (--gather {dtype_name(compute)})"
        saved = sum(int(_numel(w)) * (w.dtype.itemsize - compute.itemsize) for w, _ in used if w.dtype is not None)
        out.append(
            Finding(
                code=CODES[FindingKind.WIDE_GATHER],
                severity=Severity.INFO,
                kind=FindingKind.WIDE_GATHER,
                module=unit,
                unit=unit,
                node=used[0][0].name,
                source_line=None,
                chain=(),
                message=f"unit {target} gathers {len(used)} weight(s) at {dtype_name(used[0][0].dtype)}, but every use is an "
                f"autocast-covered op that runs at {dtype_name(compute)}: the all-gather could move {saved} fewer bytes per step",
                graph=graph_index,
                suggestion=rule,
            )
        )
    return out


def _numel(info: NodeInfo) -> int:
    value = node_value(info.node)
    try:
        return int(value.numel())
    except (AttributeError, TypeError):  # symbolic sizes: no byte figure
        return 0
