"""Op class ``moe``: a mixture-of-experts block computes its routes and experts as the engine's fused MoE does.

    router    the linear of the router (the linears rewrite, after this one, makes it the engine's GEMM), then softmax /
              top-k / renormalisation however the model writes them
              ->  fxp_engine.moe_route(logits bf16, k, renormalize)          the engine's top-k and weights
                  fxp_engine.record_routes(ids)                              the routes, to a RouteTap where open
    experts   the calls of a module holding stacked expert weights (w13 [E, 2I, H]: gate rows then up rows, w2
              [E, H, I]) on the hidden states, the routes' ids and weights (transformers' grouped_mm, or any loop)
              ->  fxp_engine.fused_moe(x, w13, w2, weights, ids)             the engine's fused experts

Found by what they do: an experts region is the nodes traced in a module that reads two 3-D float tensors of one
leading size (the expert count) from its inputs; its other inputs must be the hidden states [T, H], the expert ids
[T, k] and their weights [T, k] (anything more, e.g. expert biases, is refused); the ids must come from a top-k
over [T, experts] whose input is, through elementwise and cast ops, the router's linear. A contract whose probe
matched no MoE kernel leaves the graph to the coverage check, which refuses its routers with the probe's reason.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.annotate import param_names
from fx_precision.passes.graph.kinds import ParamKind
from fx_precision.passes.graph.linear_forms import linear_forms
from fx_precision.passes.graph.nodes import is_call, module_path, node_value
from fx_precision.passes.repropagate import repropagate
from fx_precision.passes.rewrites.engine.common import EngineRewrite, RewriteFn, record, replace_node

MOE = OpClass.MOE
ROUTER_STEPS = ("to", "float", "softmax", "view", "reshape", "contiguous")  # from the router's logits to its top-k


def _value(node: object) -> torch.Tensor | None:
    value = node_value(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _parameter(node: fx.Node, params: set[fx.Node]) -> bool:
    """``node`` is a parameter, or a cast of one (the gather's, the policy's)."""
    while node not in params:
        cast = node.op == "call_method" and node.target in ("to", "float", "bfloat16", "contiguous")
        if not cast or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return True


def experts_regions(gm: fx.GraphModule, params: set[fx.Node]) -> dict[str, list[fx.Node]]:
    """Module path -> the call nodes traced in it (and its submodules), for every module that reads two or more 3-D float
    parameters of one leading size from outside (stacked expert weights)."""
    by_path: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            by_path.setdefault(module_path(node), []).append(node)
    found = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for path in by_path:
        if not path:
            continue
        region = sorted((n for p, ns in by_path.items() if p == path or p.startswith(path + ".") for n in ns), key=order.__getitem__)
        inside = set(region)
        stacked = {a for n in region for a in n.all_input_nodes if a not in inside and (v := _value(a)) is not None
                   and v.dim() == 3 and v.is_floating_point() and _parameter(a, params)}  # fmt: skip
        leading = {_value(a).shape[0] for a in stacked}  # type: ignore[union-attr]
        if len(stacked) >= 2 and len(leading) == 1:
            found[path] = region
    # the innermost such module (a parent reads the same tensors through it)
    return {p: r for p, r in found.items() if not any(q != p and q.startswith(p + ".") for q in found)}


def _router_logits(ids: fx.Node, linears: set[fx.Node]) -> fx.Node:
    """The router linear's output behind ``ids`` (the indices of its top-k) (``linears``: the
    graph's linear outputs, however the model writes them; the linears rewrite later makes it the engine's GEMM)."""
    node = ids
    while node.op == "call_method" and node.target in ("to", "long", "reshape", "view"):
        node = node.args[0]  # type: ignore[assignment]
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1):
        raise PrecisionError(f"the expert ids at {module_path(ids) or '<root>'} are not a top-k's indices")
    topk = node.args[0]
    assert isinstance(topk, fx.Node)
    if not is_call(topk, {torch.topk}, "topk"):
        raise PrecisionError(f"the expert ids at {module_path(ids) or '<root>'} are not a top-k's indices")
    scores = topk.args[0]
    while isinstance(scores, fx.Node) and scores not in linears and not is_call(scores, {torch.ops.fxp_engine.linear.default}):
        step = scores.target if scores.op == "call_method" else getattr(scores.target, "__name__", "")
        if step not in ROUTER_STEPS:
            raise PrecisionError(f"the router at {module_path(topk) or '<root>'} computes its top-k from {scores.target} of the logits")
        scores = scores.args[0]
    if not isinstance(scores, fx.Node):
        raise PrecisionError(f"the router at {module_path(topk) or '<root>'}: no router linear before its top-k")
    return scores


def engine_moe(contract: EngineContract) -> RewriteFn:
    """The op class's rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        params = {n for n, (_, kind) in param_names(gm, ctx.example_inputs, ctx.known_names).items() if kind is ParamKind.PARAMETER}
        regions = experts_regions(gm, params)
        if not regions or contract.moe is None:  # no MoE kernel read: the coverage check refuses the router, with why
            return []
        graph, done = gm.graph, []
        linears = {form.out for form in linear_forms(gm)}
        for path, region in regions.items():
            done.append(_rewrite_region(graph, path, region, contract, params, linears))
        graph.eliminate_dead_code()
        gm.recompile()
        repropagate(gm, ctx.compute, ctx.device_type or "cpu")  # the block's output is the engine's bf16: the next rewrites read it
        return done

    return rewrite


def _native_route_weights(graph: fx.Graph, logits16: fx.Node, ids: fx.Node, renormalize: bool) -> fx.Node:
    """The router's weights as vLLM's ``_softmax_topk`` writes them after its top-k (``ids``: the engine's, in its
    unsorted order), for the training side's Inductor to compile as the compiled engine's did: softmax over the chosen
    logits (renormalised), or exp(chosen - logsumexp(all)), then fp32. Inductor computes them in fp32 and drops the
    bf16 rounding eager torch makes: its kernel, not ``moe_route``'s eager weights, is what the engine ran."""
    chosen = graph.call_method("gather", (logits16, -1, ids))
    if renormalize:
        weights = graph.call_function(torch.softmax, (chosen,), {"dim": -1})
    else:
        log_z = graph.call_function(torch.logsumexp, (logits16,), {"dim": -1, "keepdim": True})
        weights = graph.call_method("exp", (graph.call_function(operator.sub, (chosen, log_z)),))
    return graph.call_method("to", (weights, torch.float32))


def _rewrite_region(graph: fx.Graph, path: str, region: list[fx.Node], contract: EngineContract, params: set[fx.Node],
                    linears: set[fx.Node]) -> EngineRewrite:  # fmt: skip
    moe = contract.moe
    assert moe is not None
    compiled = contract.inductor is not None
    inside = set(region)
    outside = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    values = {a: _value(a) for a in outside}
    stacked = [a for a in outside if (v := values[a]) is not None and v.dim() == 3 and v.is_floating_point() and _parameter(a, params)]
    if len(stacked) != 2:
        raise PrecisionError(f"the experts at {path}: {len(stacked)} stacked weights; the engine's fused experts take two (w13, w2)")
    shapes = [tuple(values[a].shape) for a in stacked]  # type: ignore[union-attr]
    order = [(0, 1), (1, 0)]
    fits = [(i, j) for i, j in order if shapes[i][0] == shapes[j][0] == moe.experts and shapes[i][1] == 2 * shapes[j][2]
            and shapes[i][2] == shapes[j][1]]  # fmt: skip
    if not fits:
        raise PrecisionError(
            f"the experts at {path}: stacked weights {shapes[0]} and {shapes[1]} are not the engine's w13 [{moe.experts}, 2I, H] "
            f"and w2 [{moe.experts}, H, I]"
        )
    w13, w2 = stacked[fits[0][0]], stacked[fits[0][1]]
    H = shapes[fits[0][0]][2]
    rest = [a for a in outside if a not in stacked and values[a] is not None]
    hidden = [a for a in rest if values[a].is_floating_point() and values[a].dim() == 2 and values[a].shape[1] == H]  # type: ignore[union-attr]
    ids = [a for a in rest if not values[a].is_floating_point() and values[a].shape[-1] == moe.top_k]  # type: ignore[union-attr]
    weights = [a for a in rest if values[a].is_floating_point() and a not in hidden and values[a].shape[-1] == moe.top_k]  # type: ignore[union-attr]
    if len(hidden) != 1 or len(ids) != 1 or len(weights) != 1 or len(rest) != 3:
        raise PrecisionError(
            f"the experts at {path} read {', '.join(a.name for a in rest)}: the engine's fused experts take the hidden states, the "
            "expert ids and their weights only (expert biases or other operands are not followed)"
        )
    leaving = [n for n in region if any(u not in inside for u in n.users)]
    if len(leaving) != 1:
        raise PrecisionError(f"the experts at {path}: {len(leaving)} values leave the module; the engine's fused experts make one")
    out = leaving[0]
    logits = _router_logits(ids[0], linears)

    def build() -> fx.Node:
        x16, w13_16, w2_16, logits16 = (graph.call_method("to", (t, torch.bfloat16)) for t in (hidden[0], w13, w2, logits))
        route = graph.call_function(torch.ops.fxp_engine.moe_route.default, (logits16, moe.top_k, moe.renormalize))
        route_weights = graph.call_function(operator.getitem, (route, 0))
        route_ids = graph.call_function(operator.getitem, (route, 1))
        graph.call_function(torch.ops.fxp_engine.record_routes.default, (route_ids,))  # the routes, to a RouteTap if open
        if compiled:  # the compiled engine's router weights are Inductor's kernel of vLLM's native ops: the same ops here
            route_weights = _native_route_weights(graph, logits16, route_ids, moe.renormalize)
        made = graph.call_function(
            torch.ops.fxp_engine.fused_moe.default, (x16, w13_16, w2_16, route_weights, route_ids, moe.exp, moe.store, moe.combine)
        )
        # the experts return at their input's dtype as it is when the graph runs: the example values of a later layer's
        # input still hold the dtype the stream had before an earlier layer's rewrite made it the engine's bf16
        return graph.call_method("type_as", (made, hidden[0]))

    made = replace_node(graph, out, build, MOE, erase=[])
    for node in reversed(region):
        if node is not made and not node.users and node in graph.nodes:
            graph.erase_node(node)
    kernel = f"{moe.kernel}: {moe.exp} exp, {moe.store} store, {moe.combine} combine"
    return record(MOE, made, out, f"the engine's router ({moe.top_k} of {moe.experts}) and fused experts ({kernel})")


__all__ = ["engine_moe", "experts_regions"]
