"""Narrowing where autocast would narrow anyway: a wide tensor that only autocast-covered ops use.

An op autocast runs at the compute dtype (``linear``, ``sdpa``, ``matmul``) casts its float inputs
to that dtype first. A wide tensor whose every use (through views) is such an op is therefore cast
to the compute dtype at each use; casting it once, where it is produced, gives the same numbers
forward and backward, and the tensor that crosses the module boundary is half the bytes::

    model: mask = where(causal, 0., finfo(fp32).min)   fp32 ──▶ layers.0.self_attn: sdpa(q, k, v, mask)
                                                        ──▶ mask.to(bf16) at the producer (autocast
                                                            would cast it inside sdpa anyway)

That is what a hand fix does when it casts a norm's output to bf16 before the attention's linear.
Only tensors that cross a module boundary are touched (inside a module nothing is stored), never
a graph output, never a use by a custom op (its numerics are unknown) or a cast.
"""

from __future__ import annotations

import torch

from fx_precision.dtypes import is_analysed_float
from fx_precision.passes.graph.annotate import GraphAnnotation, autocast_covered_uses
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind
from fx_precision.passes.graph.nodes import node_value, redirect_through_cast


def narrow_covered_stream(ann: GraphAnnotation, compute: torch.dtype) -> list[InsertedCast]:
    """Cast, at its producer, each wide module-crossing tensor whose every use is autocast-covered."""
    casts = []
    for node, info in list(ann.info.items()):
        value = node_value(node)
        if node.op in ("placeholder", "get_attr", "output") or not isinstance(value, torch.Tensor):
            continue
        if not is_analysed_float(value.dtype) or value.dtype.itemsize <= compute.itemsize:
            continue
        uses = autocast_covered_uses(ann, node)
        if not uses or all(ann.info[u].module == info.module for u in uses):
            continue
        cast = redirect_through_cast(node, compute)
        casts.append(
            InsertedCast(
                cast.name,
                node.name,
                value.dtype,
                compute,
                f"narrowed at its producer: every use ({', '.join(sorted({u.name for u in uses})[:3])}) is autocast-covered and "
                "casts it anyway (same numbers)",
                info.module,
                kind=CastKind.COVERED,
            )
        )
    if casts:
        ann.gm.recompile()
    return casts
