"""The fix: cast each source's output to the compute dtype, right after it, so Inductor fuses the
cast into the producing kernel and everything downstream (type_as, residual adds) is narrow.

    embedding(ids, w_fp32) -> fp32        embedding(ids, w_fp32) -> fp32
        └── type_as, +, ... fp32   ──▶        └── .to(bf16)  <- inserted (source: uncovered-op)
                                                    └── type_as, +, ... bf16

A source whose value is a tuple (an op with several outputs) is cast at the ``getitem`` that
takes each wide float element out of it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fx_precision.dtypes import dtype_name, is_analysed_float
from fx_precision.passes.annotate import GraphAnnotation
from fx_precision.passes.findings import Finding
from fx_precision.passes.gather_emulation import InsertedCast
from fx_precision.passes.graph_nodes import node_value, redirect_through_cast


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


def cast_sources(ann: GraphAnnotation, sources: list[Finding], compute: torch.dtype) -> list[InsertedCast]:
    casts = []
    for finding in sources:
        info = ann.by_name(finding.node)
        for point in _cast_points(info.node, compute):
            cast = redirect_through_cast(point, compute)
            casts.append(
                InsertedCast(
                    cast.name,
                    point.name,
                    dtype_name(info.dtype),
                    dtype_name(compute),
                    f"{finding.code} {finding.kind} source: {finding.message.split(';')[0]}",
                    info.module,
                )
            )
    if casts:
        ann.gm.recompile()
    return casts
