"""Gather emulation: on one device (no FSDP2) a parameter is seen at its master dtype; cast it at
its use to the gather dtype its unit would all-gather at.

    placeholder embed_tokens.weight (fp32, master)      placeholder embed_tokens.weight (fp32)
        └── embedding(ids, w)                    ──▶        └── w.to(bf16)   <- inserted, gather of unit model.embed_tokens
                                                                  └── embedding(ids, w_bf16)

Under FSDP2 the graph already sees the gathered dtype and nothing is inserted. A parameter seen
at a dtype that is neither its gather nor its master dtype is a plan mismatch, not emulated.
"""

from __future__ import annotations

from fx_precision.dtypes import dtype_name
from fx_precision.module_graph import module_label
from fx_precision.passes.graph.annotate import GraphAnnotation, NodeInfo
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import NodeKind, ParamKind
from fx_precision.passes.graph.nodes import redirect_through_cast
from fx_precision.passes.graph.units import UnitIndex
from fx_precision.plan import ParamPlan


def emulate_gathers(ann: GraphAnnotation, units: UnitIndex) -> tuple[list[InsertedCast], list[tuple[NodeInfo, ParamPlan]]]:
    """Insert ``param.to(gather)`` for parameters seen at master dtype; return (casts, mismatches)."""
    graph = ann.gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    casts: list[InsertedCast] = []
    mismatches: list[tuple[NodeInfo, ParamPlan]] = []
    for node, info in list(ann.info.items()):
        if info.kind is not NodeKind.WEIGHT or info.param_kind is not ParamKind.PARAMETER or info.param is None or info.dtype is None:
            continue
        planned = units.param(info.param)
        if planned is None or info.dtype == planned.gather:
            continue
        if info.dtype != planned.master:
            mismatches.append((info, planned))
            continue
        cast = redirect_through_cast(node, planned.gather, before=first_op)
        casts.append(
            InsertedCast(
                cast.name,
                info.param,
                info.dtype,
                planned.gather,
                f"gather emulation: unit {module_label(planned.unit)} gathers {info.param} at {dtype_name(planned.gather)} "
                f"(seen at master {dtype_name(info.dtype)})",
                info.module,
            )
        )
    if casts:
        ann.gm.recompile()
    return casts, mismatches
