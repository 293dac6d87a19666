"""Gather emulation: on one device (no FSDP2) a parameter is seen at its master dtype; cast it at
its use to the gather dtype its unit would all-gather at.

    placeholder embed_tokens.weight (fp32, master)      placeholder embed_tokens.weight (fp32)
        └── embedding(ids, w)                    ──▶        └── w.to(bf16)   <- inserted, gather of unit model.embed_tokens
                                                                  └── embedding(ids, w_bf16)

Under FSDP2 the graph already sees the gathered dtype and nothing is inserted. A parameter seen
at a dtype that is neither its gather nor its master dtype is a plan mismatch, not emulated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fx_precision.dtypes import dtype_name
from fx_precision.passes.annotate import GraphAnnotation, NodeInfo
from fx_precision.passes.graph_nodes import redirect_through_cast
from fx_precision.passes.units import UnitIndex


class CastKind(str, enum.Enum):
    """Why the pass cast something (a ``str`` enum: JSON and old comparisons see the value)."""

    GATHER = "gather-emulation"  # a parameter to its unit's gather dtype, at its use
    SOURCE_OUTPUT = "source-output"  # a source's output to the compute dtype
    SOURCE_OPERAND = "source-operand"  # a promotion's module-crossing operand, for that use
    RETARGET = "dtype-following"  # a traced cast / factory dtype that followed a narrowed value
    COVERED = "covered-narrowing"  # a wide tensor only autocast-covered ops use, at its producer


@dataclass(frozen=True)
class InsertedCast:
    """A cast the pass inserted (or retargeted): ``node`` reads ``of`` at ``frm`` and makes ``to``."""

    node: str
    of: str
    frm: str
    to: str
    reason: str
    module: str
    fixes: str | None = None  # the source finding's node a source cast fixes
    kind: CastKind = CastKind.GATHER


def emulate_gathers(ann: GraphAnnotation, units: UnitIndex) -> tuple[list[InsertedCast], list[tuple[NodeInfo, torch.dtype]]]:
    """Insert ``param.to(gather)`` for parameters seen at master dtype; return (casts, mismatches)."""
    graph = ann.gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    casts: list[InsertedCast] = []
    mismatches: list[tuple[NodeInfo, torch.dtype]] = []
    for node, info in list(ann.info.items()):
        if info.kind != "weight" or info.param_kind != "parameter" or info.param is None or info.dtype is None:
            continue
        planned = units.param(info.param)
        if planned is None or info.dtype == planned.gather:
            continue
        if info.dtype != planned.master:
            mismatches.append((info, planned.gather))
            continue
        cast = redirect_through_cast(node, planned.gather, before=first_op)
        casts.append(
            InsertedCast(
                cast.name,
                info.param,
                dtype_name(info.dtype),
                dtype_name(planned.gather),
                f"gather emulation: unit {planned.unit or '<root>'} gathers {info.param} at {dtype_name(planned.gather)} "
                f"(seen at master {dtype_name(info.dtype)})",
                info.module,
            )
        )
    if casts:
        ann.gm.recompile()
    return casts, mismatches
