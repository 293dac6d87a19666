"""The fix: cast each source's output to the compute dtype, right after it, so Inductor fuses the
cast into the producing kernel and everything downstream (type_as, residual adds) is narrow.

    embedding(ids, w_fp32) -> fp32        embedding(ids, w_fp32) -> fp32
        └── type_as, +, ... fp32   ──▶        └── .to(bf16)  <- inserted (source: uncovered-op)
                                                    └── type_as, +, ... bf16

A source whose value is a tuple (an op with several outputs) is cast at the ``getitem`` that
takes each wide float element out of it. A promotion whose wide operand is not a parameter but a
value another module produced (GPT-2's ``wte(ids) + wpe(positions)``: ``wpe``'s output crosses
into the model) is fixed by casting that operand for this use: the crossing tensor is the one that
must be narrow, and the sum is then computed as a hand fix computes it, from two bf16 operands.

An op that needs one dtype and reads a wide weight after ``input.to(weight.dtype)`` (MoE experts:
``grouped_mm``) cannot have its output cast alone: the weight read is cast for that use, and the
input's cast, which followed the weight, is retargeted with it (``dtype_following``)::

    grouped_mm(x.to(fp32), w_fp32.transpose(-2, -1))   ──▶   grouped_mm(x.to(bf16), w_fp32.transpose(-2, -1).to(bf16))
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fx_precision.dtypes import dtype_name, is_analysed_float
from fx_precision.module_graph import module_label
from fx_precision.passes.graph.annotate import GraphAnnotation, NodeInfo
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind, FindingKind
from fx_precision.passes.graph.nodes import (
    behind_views,
    cast_for_one_use,
    is_cast,
    is_view,
    node_dtype,
    node_value,
    op_name,
    redirect_through_cast,
)
from fx_precision.passes.rules.findings import Finding


def _cast_points(node: fx.Node, compute: torch.dtype) -> list[fx.Node]:
    """The nodes whose output carries the source's wide value: itself, or its wide ``getitem``s."""
    value = node_value(node)
    if isinstance(value, torch.Tensor):
        return [node]
    points = []
    for user in node.users:
        item = node_value(user)
        if user.op == "call_function" and user.target is operator.getitem and isinstance(item, torch.Tensor):
            if is_analysed_float(item.dtype) and item.dtype.itemsize > compute.itemsize:
                points.append(user)
    return points


def _crossing_operand(ann: GraphAnnotation, info: NodeInfo) -> tuple[fx.Node, fx.Node] | None:
    """(operand, its user) for a promotion whose wide weight-derived operand another module produced:
    walks back through same-module views and dtype-keeping casts (``x.to(device)``)."""
    operand, user = info.wide_parent, info.node
    if info.source_kind is not FindingKind.PROMOTION or operand is None:
        return None
    while (
        (is_view(operand) or is_cast(operand))
        and ann.info[operand].module == info.module
        and operand.args
        and isinstance(operand.args[0], fx.Node)
        and node_dtype(operand.args[0]) == node_dtype(operand)
    ):
        user, operand = operand, operand.args[0]
    if operand.op in ("placeholder", "get_attr") or ann.info[operand].module == info.module:
        return None
    return operand, user


def _cast_weight_reads(ann: GraphAnnotation, info: NodeInfo, finding: Finding, compute: torch.dtype) -> list[InsertedCast]:
    """Cast, for the uncovered op only, each of its inputs that reads a wide parameter (through views)."""
    op, casts = info.uncovered_op, []
    assert op is not None
    for operand in list(op.all_input_nodes):
        if operand is info.node or behind_views(operand) is not info.wide_parent or node_dtype(operand) == compute:
            continue
        cast = cast_for_one_use(operand, op, compute)
        param = ann.info[info.wide_parent].param if info.wide_parent in ann.info else None
        casts.append(
            InsertedCast(
                cast.name,
                operand.name,
                node_dtype(operand),
                compute,
                f"{finding.code} {finding.kind} source: {op_name(op)} reads {param or operand.name} at "
                f"{dtype_name(node_dtype(operand))}; cast for that read",
                info.module,
                info.name,
                CastKind.WEIGHT_READ,
                finding.code,
            )
        )
    return casts


def cast_sources(ann: GraphAnnotation, sources: list[Finding], compute: torch.dtype) -> list[InsertedCast]:
    casts = []
    for finding in sources:
        info = ann.by_name(finding.node)
        if info.uncovered_op is not None:
            casts += _cast_weight_reads(ann, info, finding, compute)
            continue
        crossing = _crossing_operand(ann, info)
        if crossing is not None:
            operand, user = crossing
            cast = cast_for_one_use(operand, user, compute)
            where = module_label(ann.info[operand].module)
            reason = f"{finding.code} {finding.kind} source: its operand {operand.name} crosses from {where}"
            casts.append(
                InsertedCast(
                    cast.name,
                    operand.name,
                    ann.info[operand].dtype,
                    compute,
                    reason,
                    where,
                    info.name,
                    CastKind.SOURCE_OPERAND,
                    finding.code,
                )
            )
            continue
        for point in _cast_points(info.node, compute):
            cast = redirect_through_cast(point, compute)
            casts.append(
                InsertedCast(
                    cast.name,
                    point.name,
                    info.dtype,
                    compute,
                    f"{finding.code} {finding.kind} source: {finding.message.split(';')[0]}",
                    info.module,
                    info.name,
                    CastKind.SOURCE_OUTPUT,
                    finding.code,
                )
            )
    if casts:
        ann.gm.recompile()
    return casts
