"""Op class ``attention``: ``scaled_dot_product_attention`` as the engine's attention kernel computes it.

scaled_dot_product_attention(q, k, v, attn_mask, scale, is_causal)
->  fxp_engine.attention(q^T, k^T, v^T, key lens, mask, scale, causal, window, offset, <arithmetic>)
    the kernel's instruction, exp, lane sums, P's dtype and store (contract/ops/attention.py, attention_kernels.cpp)
unmatched: a graph with attention is refused with the probe's reason
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import module_path, node_value, source_line
from fx_precision.passes.rewrites.engine.common import EngineRewrite, RewriteFn, is_call, record, replace_node

ATTENTION = OpClass.ATTENTION
SDPA = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def _sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound: dict[str, Any] = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def _engine_call(graph: fx.Graph, a: dict[str, Any], batch: int, keys: int, arithmetic: dict[str, Any]) -> fx.Node:
    """sdpa's [B, H, T, D] operands as the op's [B, T, H, D], the op, its output back."""
    qt, kt, vt = (graph.call_method("transpose", (a[t], 1, 2)) for t in ("query", "key", "value"))
    lens = graph.call_function(torch.full, ((batch,), keys), {"dtype": torch.int64})
    out = graph.call_function(
        torch.ops.fxp_engine.attention.default,
        (qt, kt, vt, lens, a.get("attn_mask"), a["scale"], bool(a.get("is_causal", False)), -1, 0),
        arithmetic,
    )
    return graph.call_method("transpose", (out, 1, 2))


def engine_attention(contract: EngineContract) -> RewriteFn:
    """The op class's rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        found = [node for node in gm.graph.nodes if is_call(node, SDPA)]
        if not found:
            return []
        arithmetic = contract.attention
        if arithmetic is None:
            raise contract.refused(ATTENTION, module_path(found[0]))
        done = []
        graph = gm.graph
        for node in found:
            a = _sdpa_arguments(node)
            where = f"{module_path(node) or '<root>'} ({source_line(node) or node.name})"
            if a.get("dropout_p", 0.0) not in (0, 0.0):
                raise PrecisionError(f"engine contract: attention at {where} has dropout; the engine runs none (model.eval(), dropout 0)")
            qv, kv = node_value(a["query"]), node_value(a["key"])
            if not isinstance(qv, torch.Tensor) or qv.dim() != 4 or not isinstance(kv, torch.Tensor):
                raise PrecisionError(f"engine contract: attention at {where} is not [batch, heads, tokens, head_dim]; not followed")
            scale = a.get("scale")  # a Node where Dynamo lifted the module's float (another model's differed): its value at run time
            a["scale"] = scale if isinstance(scale, fx.Node) else float(scale) if scale is not None else float(qv.shape[-1]) ** -0.5
            call = functools.partial(_engine_call, graph, a, qv.shape[0], kv.shape[2], arithmetic.op_args())
            made = replace_node(graph, node, call, ATTENTION)
            done.append(record(ATTENTION, made, a["query"], f"attention as the engine's kernel: {arithmetic.describe()}"))
        gm.recompile()
        return done

    return rewrite
