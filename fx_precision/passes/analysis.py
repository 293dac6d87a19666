"""One analysis of one graph: the first step of the pass pipeline, and how every later step re-reads it.

    analyse_graph(gm)
    ├── annotate                   dtype, module, unit, parameter of every node (annotate.py)
    ├── emulate gathers (+ re-propagate)   parameters at master dtype -> unit gather dtype
    ├── annotate again             kinds, origins, stream flags
    ├── findings                   sources, explicit upcasts, wide inputs, round trips, plan, gathers
    └── census                     float nodes / stream tensors by dtype, wide stream bytes

``pipeline.run_pipeline`` calls it first (with gather emulation) and again after each rewrite.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fx_precision.passes.graph.annotate import GraphAnnotation, annotate, param_names
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.census import GraphCensus, graph_census
from fx_precision.passes.graph.kinds import CastKind, ParamKind
from fx_precision.passes.graph.units import UnitIndex
from fx_precision.passes.repropagate import repropagate
from fx_precision.passes.rewrites.dtype_following import narrowed_map, retarget_dtype_following, retarget_weight_following
from fx_precision.passes.rewrites.gather_emulation import emulate_gathers
from fx_precision.passes.rules.findings import Finding, graph_findings


@dataclass
class GraphAnalysis:
    index: int
    annotation: GraphAnnotation
    findings: list[Finding]
    census: GraphCensus
    gather_casts: list[InsertedCast] = field(default_factory=list)
    retargeted: list[InsertedCast] = field(default_factory=list)
    rounds: int = 0  # rounds of source casts the fixed point needed (lint: on a copy of the graph)

    @property
    def sources(self) -> list[Finding]:
        return [f for f in self.findings if f.is_source]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy an analysis may rewrite freely (``Graph.__deepcopy__`` copies node metas
    shallowly, so fake example values are shared, not cloned)."""
    clone = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    if hasattr(gm, "_param_name_to_source"):  # Dynamo's parameter sources: letter case of parameter names
        clone._param_name_to_source = gm._param_name_to_source
    return clone


def analyse_graph(
    gm: fx.GraphModule,
    example_inputs: list[Any] | None,
    *,
    compute: torch.dtype | None,
    units: UnitIndex,
    known_names: dict[int, tuple[str, ParamKind]] | None = None,
    emulate: bool = True,
    index: int = 0,
    fsdp_cast_inputs: bool | None = None,
    device_type: str | None = None,
) -> GraphAnalysis:
    """Annotate, emulate gathers (rewrites ``gm``), re-annotate; findings and census of the result."""
    params = param_names(gm, example_inputs, known_names)
    ann = annotate(gm, compute, units, params)
    casts: list[InsertedCast] = []
    retargeted: list[InsertedCast] = []
    mismatches: list[Any] = []
    if emulate:
        casts, mismatches = emulate_gathers(ann, units)
        if casts:
            retargeted = settle_rewrite(gm, casts, compute, device_type, before=ann)
            ann = annotate(gm, compute, units, params)
    findings = graph_findings(ann, units, graph_index=index, fsdp_cast_inputs=fsdp_cast_inputs, mismatches=mismatches)
    return GraphAnalysis(index, ann, findings, graph_census(ann), casts, retargeted)


def settle_rewrite(
    gm: fx.GraphModule, casts: list[InsertedCast], compute: torch.dtype | None, device_type: str | None, *, before: GraphAnnotation
) -> list[InsertedCast]:
    """After inserting ``casts``: retarget the casts they invalidate (those that followed a weight read into an op
    needing one dtype, then those that followed the stream), re-propagate dtypes."""
    reads = {c.node: c.to for c in casts if c.kind in (CastKind.GATHER, CastKind.WEIGHT_READ)}
    retargeted, followed = retarget_weight_following(gm, reads, before) if reads else ([], set())
    narrowed = narrowed_map(casts, compute)
    if narrowed:
        retargeted += retarget_dtype_following(gm, narrowed, {c.node for c in casts} | followed, before)
    repropagate(gm, compute, device_type)
    return retargeted
