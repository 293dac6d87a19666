"""Dtype-following casts: ``y.to(x.dtype)`` is traced by Dynamo as ``y.to(<x's dtype then>)``.

When the pass narrows a value (gather emulation, a source cast), code that *followed* that
value's dtype was specialised to the old, wide dtype at trace time:

    traced with the leak                       after narrowing the embedding
    cos.to(dtype=x.dtype)   -> .to(fp32)       .to(fp32)  <- still fp32: should follow x, now bf16
    h.to(input_dtype)       -> .to(fp32)       .to(fp32)  <- same
    h.to(torch.float32)     -> .to(fp32)       .to(fp32)  <- a literal: the program asked, keep it

A cast that, as traced, was a no-op to a dtype the pass narrowed away (so it followed a wide
value), applied to a value that was wide because of the leak or is a constant table, and whose
source line names no literal float dtype (``torch.float32``, ``.float()``, ...), followed a traced
dtype: it is retargeted to what that dtype became. ``x.to(weight.dtype)`` on a narrow ``x`` (a
real upcast as traced) is left alone. ``type_as`` needs nothing (it follows at run time). Limitation: a cast
that followed a deliberately wide value through a variable (``a.to(b.dtype)`` with ``b`` an fp32
island) cannot be told apart from one that followed the stream; every retarget is reported.
"""

from __future__ import annotations

import re

import torch
from torch import fx

from fx_precision.dtypes import dtype_name, parse_dtype
from fx_precision.passes.annotate import GraphAnnotation
from fx_precision.passes.gather_emulation import InsertedCast
from fx_precision.passes.graph_nodes import module_path, node_dtype, source_line

_LITERAL = re.compile(r"torch\.(float32|float64|float16|bfloat16|float|double|half)\b|\.(float|double|half|bfloat16)\(\)")


def _cast_target(node: fx.Node) -> tuple[str, int | str, torch.dtype] | None:
    """Where the dtype argument of a ``.to(...)`` / ``.type(...)`` sits, and its value."""
    if node.op != "call_method" or node.target not in ("to", "type"):
        return None
    for i, arg in enumerate(node.args[1:], start=1):
        if isinstance(arg, torch.dtype):
            return ("args", i, arg)
    value = node.kwargs.get("dtype")
    if isinstance(value, torch.dtype):
        return ("kwargs", "dtype", value)
    return None


def retarget_dtype_following(
    gm: fx.GraphModule, narrowed: dict[torch.dtype, torch.dtype], inserted: set[str], before: GraphAnnotation
) -> list[InsertedCast]:
    """Retarget the casts that followed a narrowed-away dtype (see the module docstring).

    ``before``: the annotation of the graph as traced, before the pass inserted anything. A cast
    qualifies when, as traced, it was a no-op to a narrowed-away dtype (so it followed a wide value)
    of a value that was wide because of the leak (a propagation) or a constant table (a weight),
    not an intentional fp32 island, and its source line names no literal float dtype.
    """
    changed = []
    for node in gm.graph.nodes:
        if node.name in inserted or node not in before.info:
            continue
        target = _cast_target(node)
        if target is None or target[2] not in narrowed:
            continue
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        traced = before.info.get(source) if source is not None else None
        if traced is None or traced.dtype != target[2] or traced.kind not in ("propagation", "source", "weight"):
            continue
        line = source_line(node) or ""
        code = line.split(": ", 1)[-1]
        if not line or _LITERAL.search(code):
            continue
        where, key, old = target
        new = narrowed[old]
        if where == "args":
            args = list(node.args)
            args[key] = new  # type: ignore[index]
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "dtype": new}
        changed.append(
            InsertedCast(
                node.name,
                node.args[0].name if isinstance(node.args[0], fx.Node) else str(node.args[0]),
                dtype_name(node_dtype(node.args[0]) if isinstance(node.args[0], fx.Node) else None),
                dtype_name(new),
                f"dtype-following cast retargeted {dtype_name(old)} -> {dtype_name(new)} (traced as {code.strip()!r})",
                module_path(node),
            )
        )
    if changed:
        gm.recompile()
    return changed


def narrowed_map(casts: list[InsertedCast], compute: torch.dtype | None) -> dict[torch.dtype, torch.dtype]:
    """``{wide dtype: what it became}`` over the casts that narrowed something (compute wins ties)."""
    out: dict[torch.dtype, torch.dtype] = {}
    for cast in casts:
        wide, new = parse_dtype(cast.frm), parse_dtype(cast.to)
        if wide.itemsize > new.itemsize and (wide not in out or new == compute):
            out[wide] = new
    return out
