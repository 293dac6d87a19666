"""Graph census: float nodes by dtype, stream tensors by dtype, and the bytes of wide stream tensors.

With ``dynamic=True`` sizes are symbols; the wide-bytes figure is then a sympy expression in
readable symbols named after the graph input dimension each came from
(``input_ids_size0 * input_ids_size1 * 256``), with the traced example sizes as hints.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from fx_precision.dtypes import dtype_name
from fx_precision.passes.graph.annotate import GraphAnnotation
from fx_precision.passes.graph.nodes import node_value, tensors_in


@dataclass
class GraphCensus:
    float_nodes: dict[str, int]
    stream: dict[str, int]
    wide_stream_bytes: sympy.Expr
    size_hints: dict[str, int] = field(default_factory=dict)

    @property
    def wide_stream_bytes_static(self) -> int:
        return int(self.wide_stream_bytes.subs({sympy.Symbol(k, integer=True, positive=True): v for k, v in self.size_hints.items()}))

    def to_dict(self) -> dict[str, Any]:
        expr = self.wide_stream_bytes
        return {
            "float_nodes": self.float_nodes,
            "stream": self.stream,
            "wide_stream_bytes": int(expr) if expr.is_number else str(expr),
            "wide_stream_bytes_at_example_sizes": self.wide_stream_bytes_static,
            "size_hints": self.size_hints,
        }


def _readable(sym: Any, shape_env: Any) -> tuple[str, int | None]:
    sources = getattr(shape_env, "var_to_sources", {}).get(sym, [])
    name = str(sym)
    if sources:
        text = sources[0].name() if callable(sources[0].name) else sources[0].name
        match = re.search(r"\[['\"]([^'\"]+)['\"]\]\.size\(\)\[(\d+)\]", text)
        if match:
            name = f"{match.group(1)}_size{match.group(2)}"
    hints = getattr(shape_env, "backed_var_to_val", None) or getattr(shape_env, "var_to_val", {})
    hint = hints.get(sym)
    return name, int(hint) if hint is not None else None


def _expr(size: Any, shape_env: Any, rename: dict[Any, sympy.Symbol], hints: dict[str, int]) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        for sym in expr.free_symbols:
            if sym not in rename:
                name, hint = _readable(sym, shape_env)
                rename[sym] = sympy.Symbol(name, integer=True, positive=True)
                if hint is not None:
                    hints[name] = hint
        return expr.xreplace(rename)
    return sympy.Integer(int(size))


def graph_census(ann: GraphAnnotation) -> GraphCensus:
    floats: Counter[str] = Counter()
    stream: Counter[str] = Counter()
    total: sympy.Expr = sympy.Integer(0)
    rename: dict[Any, sympy.Symbol] = {}
    hints: dict[str, int] = {}
    for node, info in ann.info.items():
        if info.dtype is None or not info.dtype.is_floating_point or node.op == "output":
            continue
        floats[dtype_name(info.dtype)] += 1
        if not info.stream:
            continue
        stream[dtype_name(info.dtype)] += 1
        if info.wide:
            for t in tensors_in(node_value(node)):
                if t.dtype == info.dtype:
                    shape_env = getattr(getattr(t, "fake_mode", None), "shape_env", None)
                    numel = math.prod((_expr(s, shape_env, rename, hints) for s in t.shape), start=sympy.Integer(1))
                    total = total + numel * t.dtype.itemsize
    return GraphCensus(dict(floats.most_common()), dict(stream.most_common()), sympy.expand(total), hints)
