"""``lint``: capture a model's Dynamo graphs and report where every wide dtype comes from.

LintReport
├── compute: bf16 (autocast on cpu)        from the policy, else the ambient torch.autocast
├── graphs[0]                              one per Dynamo graph (graph breaks give several)
│   ├── census: float nodes / stream tensors by dtype, wide stream bytes (sympy when dynamic)
│   └── findings: FXP001 uncovered-op at model.embed_tokens (error)
│                   source: modeling_qwen3_5.py:1236 … inputs_embeds = self.embed_tokens(input_ids)
│                   chain: model.layers.3: + -> fp32 … <- model.embed_tokens: embedding -> fp32
└── worst_severity: "error"
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from fx_precision.autocast import ambient_compute, autocast_context
from fx_precision.callable_module import make_callable
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.fsdp import fsdp_units
from fx_precision.module_graph import module_label
from fx_precision.passes.analysis import GraphAnalysis, copy_graph_module
from fx_precision.passes.capture import capture_graphs
from fx_precision.passes.context import GraphSetup, Mode
from fx_precision.passes.graph.kinds import Severity, severity_rank
from fx_precision.passes.graph.units import UnitIndex
from fx_precision.passes.pipeline import run_pipeline
from fx_precision.passes.rules.findings import Finding
from fx_precision.plan import PrecisionPlan, check_plan_matches
from fx_precision.policy import PrecisionPolicy

LINT_JSON_VERSION = 1


@dataclass
class LintReport:
    compute: torch.dtype | None
    device_type: str
    graphs: list[GraphAnalysis] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return [f for g in self.graphs for f in g.findings]

    @property
    def worst_severity(self) -> Severity | None:
        return Severity.worst(f.severity for f in self.findings)

    def reaches(self, severity: str) -> bool:
        return severity_rank(self.worst_severity) >= severity_rank(severity)

    def by_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def stream_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for g in self.graphs:
            for dtype, n in g.census.stream.items():
                total[dtype] = total.get(dtype, 0) + n
        return total

    # -- presentation --------------------------------------------------------------------------
    def render(self) -> str:
        compute = dtype_name(self.compute) if self.compute else "none (no autocast)"
        head = f"compute {compute} on {self.device_type}; {len(self.graphs)} graph(s)"
        parts = [head]
        for g in self.graphs:
            c = g.census
            parts.append(
                f"\ngraph {g.index}: {sum(c.float_nodes.values())} float nodes {c.float_nodes}; stream tensors {c.stream}; "
                f"wide stream bytes {c.to_dict()['wide_stream_bytes']}"
            )
            if g.rounds > 1:
                masked = sum(f.masked for f in g.findings)
                parts.append(
                    f"  fixed point after {g.rounds} rounds of casts: {masked} masked finding(s) surfaced once earlier sources were fixed"
                )
            if g.gather_casts:
                parts.append(f"  gather emulated for {len(g.gather_casts)} parameter(s): {', '.join(c.of for c in g.gather_casts)}")
        rows = [
            [
                f.severity,
                f.code,
                f.kind,
                module_label(f.module),
                "-" if f.unit is None else (module_label(f.unit)),
                f.node,
                f.propagations,
                f.stream_tensors,
                f"{f.round} (masked by {', '.join(f.masked_by) or '?'})" if f.masked else 0,
            ]
            for f in sorted(self.findings, key=lambda f: (-severity_rank(f.severity), f.graph, f.round, f.code))
        ]
        if rows:
            headers = ["severity", "code", "kind", "module", "unit", "node", "propagated", "wide stream", "round"]
            parts.append("\n" + tabulate(rows, headers=headers))
            parts.append("")
            parts.extend(
                f.explain() for f in sorted(self.findings, key=lambda f: (-severity_rank(f.severity), f.round)) if f.severity != "info"
            )
        else:
            parts.append("\nno findings")
        parts.append(f"\nworst severity: {self.worst_severity or 'none'}")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": LINT_JSON_VERSION,
            "compute": dtype_name(self.compute) if self.compute else None,
            "device_type": self.device_type,
            "worst_severity": str(self.worst_severity) if self.worst_severity else None,
            "graphs": [
                {
                    "index": g.index,
                    "rounds": g.rounds,
                    "census": g.census.to_dict(),
                    "gather_casts": [c.to_dict() for c in g.gather_casts],
                    "findings": [f.to_dict() for f in g.findings],
                }
                for g in self.graphs
            ],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def to_dot(self) -> str:
        """Module-level dtype flow as Graphviz DOT: modules coloured by output dtype, sources marked."""
        colour = {"fp32": "#f4a6a6", "bf16": "#a6e3a6", "fp16": "#a6c8f4", "mixed": "#f4d8a6"}
        lines = ["digraph fx_precision {", "  rankdir=TB;", '  node [shape=box, style="filled,rounded", fontname="Helvetica"];']
        for g in self.graphs:
            ann = g.annotation
            outputs: dict[str, set[str]] = {}
            edges: dict[tuple[str, str], set[str]] = {}
            for info in ann.info.values():
                if not info.stream or info.dtype is None:
                    continue
                outputs.setdefault(info.module, set()).add(dtype_name(info.dtype))
                for user in info.consumers:  # as annotated: the graph may have been fixed since
                    target = ann.info[user].module if user.op != "output" else "<graph output>"
                    if target != info.module:
                        edges.setdefault((info.module, target), set()).add(dtype_name(info.dtype))
            sources = {f.module: f for f in g.sources}
            modules = sorted(set(outputs) | {m for e in edges for m in e})
            for module in modules:
                dtypes = outputs.get(module, set())
                fill = colour.get(next(iter(dtypes)) if len(dtypes) == 1 else "mixed", "#eeeeee") if dtypes else "#eeeeee"
                label = f"{module_label(module)}\\n{'/'.join(sorted(dtypes)) or '-'}"
                extra = ""
                if module in sources:
                    label += f"\\nSOURCE {sources[module].code} {sources[module].kind}"
                    extra = ", peripheries=2, penwidth=2, color=red"
                lines.append(f'  "g{g.index}:{module}" [label="{label}", fillcolor="{fill}"{extra}];')
            for (a, b), dtypes in sorted(edges.items()):
                lines.append(f'  "g{g.index}:{a}" -> "g{g.index}:{b}" [label="{"/".join(sorted(dtypes))}"];')
        lines.append("}")
        return "\n".join(lines)


def _device_type_of(model: nn.Module) -> str:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device.type
    return "cpu"


def _units_for(plan: PrecisionPlan | None, wrapped: list[tuple[str, Any]]) -> UnitIndex:
    """Units from the plan, else from the model's FSDP2 units, else the root alone."""
    if plan is not None:
        return UnitIndex.from_plan(plan)
    if wrapped:
        return UnitIndex.from_units({fqn: mp.param_dtype for fqn, mp in wrapped})
    return UnitIndex.from_units({"": None})


def graph_setup(model: nn.Module, policy: PrecisionPolicy | None, plan: PrecisionPlan | None, device_type: str | None) -> GraphSetup:
    """The compute dtype (the policy's, else the ambient autocast) and device type, checked; the units
    (plan, else the model's FSDP2 units, else the root); whether FSDP2 re-casts unit inputs."""
    if device_type is not None and device_type not in ("cpu", "cuda"):
        raise PrecisionError(f"lint(device_type={device_type!r}): autocast op lists exist for 'cpu' and 'cuda'; pass one of them")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise PrecisionError(
            "lint(device_type='cuda'): this torch sees no CUDA device, so cuda autocast would be off and every node fp32; "
            "lint on a GPU machine, or lint the cpu op lists with device_type='cpu'"
        )
    if plan is not None:
        check_plan_matches(plan, model)
    model_device = _device_type_of(model)
    if policy is not None:
        compute = policy.compute
        device_type = device_type or (model_device if model_device != "meta" else "cpu")
    else:
        candidates = [device_type] if device_type else ([model_device] if model_device != "meta" else ["cuda", "cpu"])
        compute, found = ambient_compute(candidates)
        device_type = device_type or found or (model_device if model_device != "meta" else "cpu")
    if device_type == "meta":
        raise PrecisionError("device_type='meta' has no autocast op lists; pass device_type='cpu' or 'cuda'")
    wrapped = fsdp_units(model)
    fsdp_cast = any(mp.cast_forward_inputs for _, mp in wrapped) if wrapped else None
    return GraphSetup(compute, device_type, _units_for(plan, wrapped), fsdp_cast)


def lint(
    model: nn.Module,
    *args: Any,
    policy: PrecisionPolicy | None = None,
    plan: PrecisionPlan | None = None,
    dynamic: bool = False,
    device_type: str | None = None,
    **kwargs: Any,
) -> LintReport:
    """Capture ``model(*args, **kwargs)`` with Dynamo and analyse every graph.

    ``policy=None``: the compute dtype is the ambient ``torch.autocast`` state. ``plan``: unit
    attribution, and gather emulation for parameters the graph sees at master dtype (one device,
    no FSDP2). ``device_type``: whose autocast op lists apply (default: the model's device; for a
    meta model ``cpu`` unless an ambient ``cuda`` autocast says otherwise). Works on real
    tensors, meta-device models and fake tensors.
    """
    setup = graph_setup(model, policy, plan, device_type)
    compute, device_type = setup.compute, setup.device_type
    # a policy without compute dtype overrides an ambient autocast: trace with autocast off
    with torch.autocast(device_type, enabled=False) if compute is None else contextlib.nullcontext():
        captured, names = capture_graphs(
            model, args, kwargs, dynamic=dynamic, device_type=device_type, autocast=autocast_context(compute, device_type)
        )
    report = LintReport(compute, device_type)
    for i, cap in enumerate(captured):
        ctx = setup.context(cap.example_inputs, i, names=names, emulate=plan is not None)
        # every round on a copy: the findings of the graph as traced, then the masked ones
        report.graphs.append(run_pipeline(copy_graph_module(cap.gm), ctx, Mode.REPORT).report_analysis())
    return report


make_callable(__name__, lint)  # fxp.lint(...) calls the function; import fx_precision.lint binds this module
