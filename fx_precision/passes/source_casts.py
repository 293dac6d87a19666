"""The fix: cast each source's output to the compute dtype, right after it, so Inductor fuses the
cast into the producing kernel and everything downstream (type_as, residual adds) is narrow.

    embedding(ids, w_fp32) -> fp32        embedding(ids, w_fp32) -> fp32
        └── type_as, +, ... fp32   ──▶        └── .to(bf16)  <- inserted (source: uncovered-op)
                                                    └── type_as, +, ... bf16
"""

from __future__ import annotations

import torch

from fx_precision.dtypes import dtype_name
from fx_precision.passes.annotate import GraphAnnotation
from fx_precision.passes.findings import Finding
from fx_precision.passes.gather_emulation import InsertedCast
from fx_precision.passes.graph_nodes import redirect_through_cast


def cast_sources(ann: GraphAnnotation, sources: list[Finding], compute: torch.dtype) -> list[InsertedCast]:
    casts = []
    for finding in sources:
        info = ann.by_name(finding.node)
        node = info.node
        if not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue  # a tuple-valued source: its getitems would need casting; not produced by the analysis today
        cast = redirect_through_cast(node, compute)
        casts.append(
            InsertedCast(
                cast.name,
                node.name,
                dtype_name(info.dtype),
                dtype_name(compute),
                f"{finding.code} {finding.kind} source: {finding.message.split(';')[0]}",
                info.module,
            )
        )
    if casts:
        ann.gm.recompile()
    return casts
