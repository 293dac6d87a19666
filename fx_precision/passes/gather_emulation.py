"""Gather emulation: on one device (no FSDP2) a parameter is seen at its master dtype; cast it at
its use to the gather dtype its unit would all-gather at.

    placeholder embed_tokens.weight (fp32, master)      placeholder embed_tokens.weight (fp32)
        └── embedding(ids, w)                    ──▶        └── w.to(bf16)   <- inserted, gather of unit model.embed_tokens
                                                                  └── embedding(ids, w_bf16)

Under FSDP2 the graph already sees the gathered dtype and nothing is inserted. A parameter seen
at a dtype that is neither its gather nor its master dtype is a plan mismatch, not emulated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from fx_precision.dtypes import dtype_name
from fx_precision.module_graph import module_label
from fx_precision.passes.annotate import GraphAnnotation, NodeInfo
from fx_precision.passes.graph_nodes import redirect_through_cast
from fx_precision.passes.kinds import CastKind
from fx_precision.passes.units import UnitIndex
from fx_precision.plan import ParamPlan


@dataclass(frozen=True)
class InsertedCast:
    """A cast the pass inserted (or retargeted): ``node`` reads ``of`` at ``frm`` and makes ``to``."""

    node: str
    of: str
    frm: torch.dtype | None
    to: torch.dtype
    reason: str
    module: str
    fixes: str | None = None  # the source finding's node a source cast fixes
    kind: CastKind = CastKind.GATHER

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: dtypes by name (``bf16``), the kind by value (``gather-emulation``)."""
        return {**asdict(self), "frm": dtype_name(self.frm), "to": dtype_name(self.to), "kind": str(self.kind)}


def emulate_gathers(ann: GraphAnnotation, units: UnitIndex) -> tuple[list[InsertedCast], list[tuple[NodeInfo, ParamPlan]]]:
    """Insert ``param.to(gather)`` for parameters seen at master dtype; return (casts, mismatches)."""
    graph = ann.gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    casts: list[InsertedCast] = []
    mismatches: list[tuple[NodeInfo, ParamPlan]] = []
    for node, info in list(ann.info.items()):
        if info.kind != "weight" or info.param_kind != "parameter" or info.param is None or info.dtype is None:
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
