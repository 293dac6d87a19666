"""Op class ``rotary``: q and k rotated as the engine's kernel rotates them.

(x * cos) + (cat(-x[..., h:], x[..., :h]) * sin)                    transformers' apply_rotary_pos_emb
->  cat(x1*c - x2*s, x2*c + x1*s) in fp32, one store to bf16        kernel, nearest-even: in the graph (each
                                                                    product of two bf16 values is exact, so
                                                                    Inductor may fuse it and the bits hold)
->  fxp_engine.rotary(x, cos, sin, rounding)                        kernel, truncating store: the op
->  the same in the graph from the unrounded fp32 product of the     inductor: the compiled engine fuses its q / k norm
    q / k norm where one feeds it (norm.UNROUNDED)                  and the rotary into one kernel
native / none: nothing to rewrite; unmatched: a graph with the pattern is refused with the probe's reason
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass, RotaryForm, Rounding
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import module_path, node_dtype, node_value, source_line
from fx_precision.passes.rewrites.engine.common import ADD, MUL, EngineRewrite, RewriteFn, is_call, record, replace_node
from fx_precision.passes.rewrites.engine.norm import UNROUNDED

ROTARY = OpClass.ROTARY


def _half(node: object, base: fx.Node, first: bool) -> bool:
    """``base[..., :h]`` (first) or ``base[..., h:]`` of the last dimension."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem and node.args[0] is base):
        return False
    index = node.args[1]
    last = index[-1] if isinstance(index, tuple) else index
    if not isinstance(last, slice) or last.step not in (None, 1):
        return False
    width = node_value(base).shape[-1] if isinstance(node_value(base), torch.Tensor) else None
    half = width // 2 if isinstance(width, int) else None
    if first:
        return last.start in (None, 0) and last.stop == half
    return last.start == half and last.stop in (None, width)


def _rotate_half_of(node: object) -> fx.Node | None:
    """``x`` when ``node`` is ``cat((-x[..., h:], x[..., :h]), dim=-1)``."""
    if not is_call(node, torch.cat):
        return None
    parts = node.args[0] if node.args else None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    value = node_value(node)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(value, torch.Tensor) or dim not in (-1, value.dim() - 1):
        return None
    neg, first = parts
    if not is_call(neg, {operator.neg, torch.neg}, "neg"):
        return None
    second = neg.args[0]
    base = second.args[0] if isinstance(second, fx.Node) and second.args else None
    if isinstance(base, fx.Node) and _half(second, base, first=False) and _half(first, base, first=True):
        return base
    return None


def _rotary_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(x, cos, sin) when ``node`` is ``x * cos + rotate_half(x) * sin`` (either order)."""
    if not is_call(node, ADD, "add") or len(node.args) < 2:
        return None
    for plain, turned in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (is_call(plain, MUL, "mul") and is_call(turned, MUL, "mul")):
            continue
        for rot, sin in ((turned.args[0], turned.args[1]), (turned.args[1], turned.args[0])):
            x = _rotate_half_of(rot)
            if x is None:
                continue
            for base, cos in ((plain.args[0], plain.args[1]), (plain.args[1], plain.args[0])):
                if base is x and isinstance(cos, fx.Node) and isinstance(sin, fx.Node):
                    return x, cos, sin
    return None


_VIEWS = ("transpose", "view", "reshape", "permute", "contiguous", "unsqueeze", "squeeze")


def _unrounded(graph: fx.Graph, x: fx.Node) -> fx.Node | None:
    """The fp32 product a norm's bf16 output rounds (norm.UNROUNDED), through the views between it and ``x``, rebuilt
    on the product; None where ``x`` is not such an output."""
    views: list[fx.Node] = []
    node = x
    while UNROUNDED not in node.meta:
        if node.op != "call_method" or node.target not in _VIEWS or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        views.append(node)
        node = node.args[0]
    value: fx.Node = node.meta[UNROUNDED]
    for view in reversed(views):
        value = graph.call_method(str(view.target), (value, *view.args[1:]), dict(view.kwargs))
    return value


def _rotation(gm: fx.GraphModule, x: fx.Node, cos: fx.Node, sin: fx.Node, rounding: Rounding, fused: bool = False) -> fx.Node:
    """The engine kernel's rotation written into the graph: ``x1*c - x2*s | x2*c + x1*s`` in fp32 from bf16
    operands (c, s: the first halves of cos, sin), one store to bf16. Each product of two bf16 values is exact
    in fp32, so whatever Inductor fuses or contracts into a multiply-add, the one rounding is the sum's: the
    same bits as the engine, and Inductor keeps the rotation in the kernel around it. A truncating store is
    the custom op (``fxp_engine.rotary``)."""
    graph = gm.graph

    def call(target: object, *args: object, method: bool = False) -> fx.Node:
        return graph.call_method(target, args) if method else graph.call_function(target, args)  # type: ignore[arg-type]

    if fused:  # the compiled engine reads its bf16 tables from memory: a rounding Inductor must not drop
        c16, s16 = (call(torch.ops.fxp_engine.stored.default, t, torch.bfloat16) for t in (cos, sin))
    else:
        c16, s16 = call("to", cos, torch.bfloat16, method=True), call("to", sin, torch.bfloat16, method=True)
    if rounding != Rounding.NEAREST_EVEN:
        return call(torch.ops.fxp_engine.rotary.default, x, c16, s16, rounding.code)
    width = node_value(x).shape[-1]
    half = width // 2
    x32, c32, s32 = (call("float", t, method=True) for t in (x, c16, s16))
    if fused:  # the compiled engine: the rotary reads its q / k norm's fp32 product, never stored
        x32 = _unrounded(graph, x) or x32
    first, second = (Ellipsis, slice(None, half)), (Ellipsis, slice(half, None))
    x1, x2 = call(operator.getitem, x32, first), call(operator.getitem, x32, second)
    c, s = call(operator.getitem, c32, first), call(operator.getitem, s32, first)
    low = call(operator.sub, call(operator.mul, x1, c), call(operator.mul, x2, s))
    high = call(operator.add, call(operator.mul, x2, c), call(operator.mul, x1, s))
    out = graph.call_function(torch.cat, ((low, high),), {"dim": -1})
    return call("to", out, torch.bfloat16, method=True)


def engine_rotary(contract: EngineContract) -> RewriteFn:
    """The op class's rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        found = [(node, parts) for node in gm.graph.nodes if (parts := _rotary_parts(node)) is not None]
        if found and contract.rotary is None:
            raise contract.refused(ROTARY, module_path(found[0][0]))
        if contract.rotary is None or contract.rotary.form not in (RotaryForm.KERNEL, RotaryForm.INDUCTOR):
            return []
        fused = contract.rotary.form == RotaryForm.INDUCTOR
        rounding = contract.rotary.rounding if contract.rotary.rounding is not None else Rounding.NEAREST_EVEN
        done = []
        for node, (x, cos, sin) in found:
            if node_dtype(x) != torch.bfloat16:
                raise PrecisionError(
                    f"engine contract: rotary at {module_path(node) or '<root>'} ({source_line(node) or node.name}) rotates a "
                    f"{dtype_name(node_dtype(x))} tensor; the engine's kernel takes bf16. Run under bf16 autocast with bf16 gathers"
                )
            made = replace_node(gm.graph, node, functools.partial(_rotation, gm, x, cos, sin, rounding, fused), ROTARY, erase=())
            done.append(record(ROTARY, made, x, f"rotary as the engine's kernel: fp32 math, one {rounding} store"))
        if done:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return done

    return rewrite
