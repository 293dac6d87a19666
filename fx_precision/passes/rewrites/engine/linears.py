"""Op class ``linears``: every linear summed in the order of the engine call that computed its row.

F.linear(x, w, b) | x @ w.T (+ b) | addmm(b, x, w)                       however the model writes it
->  fxp_engine.linear(x, w, b, logits, engine_out, where)                each row in the order of the engine
                                                                         call that computed it (the row plan)
the output projection's rows by the logits calls (``logits``), every other linear's by the forward steps;
linears reading one input are one engine GEMM (q, k, v; gate, up): ``engine_out`` is their summed width.
A contract that read no linear order, or could not read one the run made, refuses a graph with linears.
"""

from __future__ import annotations

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.linear_forms import LinearForm, linear_forms
from fx_precision.passes.graph.nodes import module_path, node_value
from fx_precision.passes.rewrites.engine.common import EngineRewrite, RewriteFn, reaches_output, record, replace_node

LINEARS = OpClass.LINEARS


def _width(form: LinearForm) -> int:
    return int(node_value(form.weight).shape[1 if form.transposed else 0])


def _parent(form: LinearForm) -> str:
    return module_path(form.out).rpartition(".")[0]


def _engine_width(form: LinearForm, forms: list[LinearForm], read: set[tuple[int, int]]) -> int:
    """The output width of the engine GEMM this linear may be part of: engines fuse the linears that read one input
    (q, k and v into qkv; gate and up into gate_up), so their summed width (0 where it reads its input alone). Where
    the engine read no call of that width (``read``: the contract's (out, in) shapes), the siblings of one parent
    module (an MoE block's shared expert's gate and up, beside its router and the shared expert's gate, which read
    the same input as GEMMs of their own); where none of that either, its own width (the op's fallback: parallel
    blocks)."""
    siblings = [f for f in forms if f.x is form.x]
    if len(siblings) < 2:
        return 0
    k = int(node_value(form.weight).shape[0 if form.transposed else 1])
    together = sum(_width(f) for f in siblings)
    family = [f for f in siblings if _parent(f) == _parent(form)]
    if (together, k) not in read and len(family) > 1 and (sum(_width(f) for f in family), k) in read:
        return sum(_width(f) for f in family)
    if (together, k) not in read and len(family) > 1:  # a run of the family fused (Qwen3.5's qkv + z into qkvz, b + a into ba)
        at = family.index(form)
        runs = [sum(_width(f) for f in family[a:b]) for a in range(at + 1) for b in range(at + 1, len(family) + 1) if b - a > 1]
        fused = [w for w in runs if (w, k) in read]
        if fused:
            return max(fused)
    if (together, k) not in read and (_width(form), k) in read:
        return 0
    return together


def engine_linears(contract: EngineContract) -> RewriteFn:
    """The op class's rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        forms = linear_forms(gm)
        if forms and (not contract.linears.calls or LINEARS in contract.why_unmatched()):
            raise contract.refused(LINEARS, module_path(forms[0].out))
        read = {(c.out_features, c.in_features) for c in contract.linears.calls}
        widths = [_engine_width(f, forms, read) for f in forms]
        graph = gm.graph
        done = []
        for form, width in zip(forms, widths, strict=True):
            logits = reaches_output(form.out)

            def build(form: LinearForm = form, width: int = width, logits: bool = logits) -> fx.Node:
                weight = graph.call_method("t", (form.weight,)) if form.transposed else form.weight
                x16, w16 = (graph.call_method("to", (t, torch.bfloat16)) for t in (form.x, weight))
                b16 = graph.call_method("to", (form.bias, torch.bfloat16)) if form.bias is not None else None
                return graph.call_function(torch.ops.fxp_engine.linear.default, (x16, w16, b16, logits, width, module_path(form.out)))

            made = replace_node(graph, form.out, build, LINEARS, erase=form.replaced)
            role = "the logits" if logits else "a body linear"
            fused = f" (part of the engine's {width}-wide GEMM)" if width else ""
            done.append(record(LINEARS, made, form.x, f"{role}{fused}: each row summed in the order of the engine call that computed it"))
        if done:
            graph.eliminate_dead_code()
            gm.recompile()
        return done

    return rewrite
