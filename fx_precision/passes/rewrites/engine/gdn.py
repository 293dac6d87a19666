"""Op class ``gdn``: a GatedDeltaNet layer's conv, gating and delta rule, and its gated norm, as the engine computes them.

Found by what the layer's ops do, in the module that runs a depthwise causal conv (Qwen3-Next's, Qwen3.5's linear
attention, whatever its projections' layout)::

    x [B, C, T] ──conv1d (groups = C)──silu── split q | k | v ── ... the delta rule (any form: chunked, recurrent,
    a ──softplus(a.float() + dt_bias)──┐                                  fused in a kernel module) ... ──▶ out [B, T, Hv, D]
    A_log ──exp(A_log.float())─────────┴─ g                                                               │
    b ──sigmoid── beta                                                                                    ▼
                                                       the gated norm's region: x * rsqrt(mean(x^2) + eps) ... * silu(z)
->  fxp_engine.gdn(x, conv weight, a, b, A_log, dt_bias, key heads, state, eps, kernels)          [B, T, Hv, D], the engine's pieces
->  fxp_engine.gated_rms_norm(out, z, norm weight, eps)                                  vLLM's RMSNormGated, eagerly
    or, under the compiled engine (whose Inductor fuses RMSNormGated.forward_native between the core op and out_proj):
    ((x.float() * rsqrt(mean(x.float() ** 2) + eps)) * w.float() * silu(z.float())).to(x.dtype)   the same native ops,
                                                       for the training side's Inductor; the norm rewrite then sums its
                                                       squares in the engine's order (contract.norm_reductions)

Everything the layer computed between its projections and out_proj that the new ops replace is dropped. A layer
whose ops are not of this form (a transformers release that moved them) is refused in one line naming what was not
found, never left half rewritten; a graph with such a layer under a contract whose probe read no GatedDeltaNet form
is refused with the probe's reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import behind_views, is_cast, is_view, module_path, node_value, source_line
from fx_precision.passes.repropagate import repropagate
from fx_precision.passes.rewrites.engine.common import EngineRewrite, RewriteFn, is_call, record, replace_node

GDN = OpClass.GDN
CONV1D = {torch.conv1d, torch.nn.functional.conv1d}
SIGMOID = {torch.sigmoid, torch.nn.functional.sigmoid}
SOFTPLUS = {torch.nn.functional.softplus}
SILU = {torch.nn.functional.silu}
EXP = {torch.exp}
ADD = {operator.add, torch.add}
MEAN = {torch.mean}


def _arg(node: fx.Node, index: int, name: str) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _depthwise(node: fx.Node) -> bool:
    """A conv1d whose groups equal its channels (a depthwise causal conv), reading a 3-D weight."""
    if not is_call(node, CONV1D):
        return False
    x, weight, groups = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 6, "groups")
    xv = node_value(x) if isinstance(x, fx.Node) else None
    wv = node_value(weight) if isinstance(weight, fx.Node) else None
    return isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and wv.dim() == 3 and groups == xv.shape[1] == wv.shape[0]


def _behind_casts(node: fx.Node) -> fx.Node:
    """Back through views and casts (``x.float()``, ``w.squeeze(1)``) to what they read."""
    while isinstance(node, fx.Node) and (is_view(node) or is_cast(node)) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _uncast(node: fx.Node) -> fx.Node:
    """Back through casts only (``a.float()``: exact on bf16 values)."""
    while is_cast(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _param(node: object) -> fx.Node | None:
    found = _behind_casts(node) if isinstance(node, fx.Node) else None
    return found if found is not None and found.op in ("placeholder", "get_attr") else None


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _descendants(start: fx.Node, within: str, *, exact: bool = False) -> set[fx.Node]:
    """What ``start`` feeds inside module ``within`` (``exact``: in its own code, not its submodules')."""
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        for user in node.users:
            path = module_path(user)
            if user not in seen and (path == within if exact else _inside(path, within)):
                seen.add(user)
                stack.append(user)
    return seen


class _Layer:
    """One GatedDeltaNet layer's nodes (module docstring), or the one-line reason it is not of the form."""

    def __init__(self, conv: fx.Node) -> None:
        self.conv = conv
        self.module = module_path(conv)
        where = f"the GatedDeltaNet layer at {self.module or '<root>'} ({source_line(conv) or conv.name})"
        graph = conv.graph
        here = [n for n in graph.nodes if module_path(n) == self.module]
        x = _arg(conv, 0, "input")
        assert isinstance(x, fx.Node)
        self.x = _uncast(x)  # the conv's bf16 input (the fp32 cast a torch fallback adds: exact)
        weight = _param(_arg(conv, 1, "weight"))
        sigmoid = [n for n in here if is_call(n, SIGMOID, "sigmoid")]
        softplus = [n for n in here if is_call(n, SOFTPLUS)]
        decay = [n for n in here if is_call(n, EXP, "exp") and _param(n.args[0]) is not None]
        missing = [what for what, found in (("the conv's weight", weight is not None), ("beta = sigmoid(b)", len(sigmoid) == 1),
                                            ("softplus(a + dt_bias)", len(softplus) == 1), ("exp(A_log)", len(decay) == 1))
                   if not found]  # fmt: skip
        if missing:
            raise _unreadable(where, f"found no single {', '.join(missing)}")
        assert weight is not None
        self.weight = weight
        self.b = sigmoid[0].args[0]
        self.A_log = _param(decay[0].args[0])
        total = softplus[0].args[0]
        if not isinstance(total, fx.Node) or not is_call(total, ADD):
            raise _unreadable(where, "softplus reads no sum a + dt_bias")
        operands = [a for a in total.args if isinstance(a, fx.Node)]
        params = [a for a in operands if _param(a) is not None]
        acts = [a for a in operands if _param(a) is None]
        if len(params) != 1 or len(acts) != 1:
            raise _unreadable(where, "softplus's sum is not one activation a and one parameter dt_bias")
        self.dt_bias = _param(params[0])
        self.a = _uncast(acts[0])
        self.out, self.norm = self._output(where)
        batch, channels, _ = node_value(self.x).shape
        a_value = node_value(self.a)
        hv = int(a_value.shape[-1])
        out_value = node_value(self.out)
        if not isinstance(out_value, torch.Tensor) or out_value.dim() != 4 or int(out_value.shape[2]) != hv:
            raise _unreadable(where, f"the delta rule's output is {tuple(getattr(out_value, 'shape', ()))}, not [B, T, {hv}, D]")
        d = int(out_value.shape[-1])
        if (channels - hv * d) % (2 * d) or hv % ((channels - hv * d) // (2 * d) or 1):
            raise _unreadable(where, f"{channels} conv channels are not q | k | v of heads of dim {d} with {hv} value heads")
        self.key_heads = (channels - hv * d) // (2 * d)
        self.value_heads, self.head_dim, self.batch = hv, d, batch

    def _output(self, where: str) -> tuple[fx.Node, list[fx.Node]]:
        """The delta rule's output (the value the gated norm's region reads, behind views) and that region's nodes."""
        derived = _descendants(self.conv, self.module, exact=True)  # the layer's own code after the conv, up to a submodule
        entering = [n for n in derived if any(module_path(u) != self.module and _inside(module_path(u), self.module) for u in n.users)]
        outs = {behind_views(n) for n in entering}
        if len(outs) != 1:
            raise _unreadable(where, f"the delta rule's output enters {len(outs)} submodules' code (expected one: the gated norm)")
        (out,) = outs
        norm_path = next(module_path(u) for n in entering for u in n.users if module_path(u) != self.module)
        norm = [n for n in out.graph.nodes if module_path(n) == norm_path]
        return out, norm


def _unreadable(where: str, what: str) -> PrecisionError:
    """A layer the analysis cannot read (a transformers release that moved its code): one line, never a half rewrite."""
    from fx_precision.hf import TESTED_TRANSFORMERS, transformers_version

    version = transformers_version()
    release = f" (transformers {version})" if version else ""
    return PrecisionError(
        f"engine contract: {where}{release}: {what}; the contract follows GatedDeltaNet layers of the form transformers "
        f"{TESTED_TRANSFORMERS} writes (a depthwise causal conv, sigmoid(b), softplus(a + dt_bias) * -exp(A_log), a gated "
        "norm): report the architecture and this line"
    )


class _GatedNorm:
    """The gated norm's region: the x it normalises (the delta rule's output, through views), the gate z, the weight,
    eps, and the value it returns (read by what its ops do: the mean of x's squares, silu of z)."""

    def __init__(self, nodes: list[fx.Node], layer_out: fx.Node, where: str) -> None:
        inside = set(nodes)
        means = [n for n in nodes if is_call(n, MEAN, "mean")]
        silus = [n for n in nodes if is_call(n, SILU, "silu")]
        if len(means) != 1 or len(silus) != 1:
            raise _unreadable(where, f"its gated norm holds {len(means)} mean(s) and {len(silus)} silu(s) (expected one each)")
        eps_add = next((u for u in means[0].users if is_call(u, ADD)), None)
        eps = next((a for a in eps_add.args if isinstance(a, (int, float))), None) if eps_add is not None else None
        if eps is None:
            raise _unreadable(where, "its gated norm adds no constant eps to the mean of squares")
        self.eps = float(eps)
        z = _uncast(silus[0].args[0])  # type: ignore[arg-type]
        self.z = z
        entering = {a for n in nodes for a in n.all_input_nodes if a not in inside}
        xs = [a for a in entering if behind_views(a) is layer_out or a is layer_out]
        params = [a for a in entering if a.op in ("placeholder", "get_attr")]
        params += [n for n in nodes if n.op in ("placeholder", "get_attr")]  # a lifted parameter carries its module's stack
        if len(xs) != 1 or len(params) != 1:
            raise _unreadable(where, f"its gated norm reads {len(xs)} input(s) from the delta rule and {len(params)} parameter(s)")
        self.x, self.weight = xs[0], params[0]
        leaving = [n for n in nodes if any(u not in inside for u in n.users)]
        if len(leaving) != 1:
            raise _unreadable(where, f"its gated norm returns {len(leaving)} values (expected one)")
        self.out = leaving[0]
        value = node_value(self.out)
        self.dtype = value.dtype if isinstance(value, torch.Tensor) else torch.bfloat16  # what the norm stores: x's dtype
        self.nodes = nodes


def _erase_dead(graph: fx.Graph, candidates: set[fx.Node]) -> None:
    """Erase the candidates no live node reads any more, in-place writes into a dead tensor included: a candidate is
    live where a node outside the candidates (or the graph's output) reads it, directly or through live candidates."""
    live: set[fx.Node] = set()
    stack = [n for n in graph.nodes if n not in candidates]
    while stack:
        node = stack.pop()
        for inp in node.all_input_nodes:
            if inp in candidates and inp not in live:
                live.add(inp)
                stack.append(inp)
    for node in reversed(list(graph.nodes)):
        if node in candidates and node not in live and node.op not in ("placeholder", "output"):
            graph.erase_node(node)


def _caller(graph: fx.Graph, target: Any, args: tuple[Any, ...]) -> Callable[[], fx.Node]:
    return lambda: graph.call_function(target, args)


def _made(graph: fx.Graph) -> set[fx.Node]:
    from fx_precision.passes.graph.nodes import ENGINE_MADE

    return {n for n in graph.nodes if n.meta.get(ENGINE_MADE)}


def _native_gated_norm(graph: fx.Graph, norm: _GatedNorm) -> Callable[[], fx.Node]:
    """vLLM's ``RMSNormGated.forward_static`` (norm before the gate, silu) as the ops the compiled engine's Inductor
    fuses: every step in fp32, one rounding at the end."""

    def build() -> fx.Node:
        xf = graph.call_method("to", (norm.x, torch.float32))
        squares = graph.call_method("pow", (xf, 2))
        variance = graph.call_method("mean", (squares,), {"dim": -1, "keepdim": True})
        root = graph.call_function(torch.rsqrt, (graph.call_function(operator.add, (variance, norm.eps)),))
        scaled = graph.call_function(operator.mul, (xf, root))
        weighted = graph.call_function(operator.mul, (scaled, graph.call_method("to", (norm.weight, torch.float32))))
        gate = graph.call_function(torch.nn.functional.silu, (graph.call_method("to", (norm.z, torch.float32)),))
        return graph.call_method("to", (graph.call_function(operator.mul, (weighted, gate)), norm.dtype))

    return build


def engine_gdn(contract: EngineContract) -> RewriteFn:
    """The op class's rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        convs = [node for node in gm.graph.nodes if _depthwise(node)]
        if not convs:
            return []
        form = contract.gdn
        if form is None:
            raise contract.refused(GDN, module_path(convs[0]))
        layers = [_Layer(conv) for conv in convs]  # every layer read before any is rewritten: nothing half done
        norms = [_GatedNorm(layer.norm, layer.out, f"the GatedDeltaNet layer at {layer.module}") for layer in layers]
        graph = gm.graph
        done = []
        for layer, norm in zip(layers, norms, strict=True):
            region = _descendants(layer.conv, layer.module) | {layer.conv}
            region |= {n for n in graph.nodes if module_path(n) == layer.module and n not in (layer.x, layer.a, layer.b)}
            old_out = layer.out
            args = (layer.x, layer.weight, layer.a, layer.b, layer.A_log, layer.dt_bias, layer.key_heads, form.state == "bf16",
                    float(form.eps), form.kernels, layer.module)  # fmt: skip
            new = replace_node(graph, old_out, _caller(graph, torch.ops.fxp_engine.gdn.default, args), GDN, erase=())
            done.append(record(GDN, new, old_out, f"conv, gating and delta rule in the engine's pieces ({form.describe()})"))
            if contract.inductor is not None:  # the compiled engine: Inductor's code of vLLM's native ops
                normed = replace_node(graph, norm.out, _native_gated_norm(graph, norm), GDN, erase=())
                how = "the gated norm as vLLM's native ops, for Inductor (the compiled engine fuses them)"
            else:
                norm_args = (norm.x, norm.z, norm.weight, norm.eps)
                eager_norm = _caller(graph, torch.ops.fxp_engine.gated_rms_norm.default, norm_args)
                normed = replace_node(graph, norm.out, eager_norm, GDN, erase=())
                how = "the gated norm in fp32, one rounding (vLLM's RMSNormGated)"
            done.append(record(GDN, normed, norm.out, how))
            _erase_dead(graph, (region | set(norm.nodes)) - {new, normed} - _made(graph))
        gm.recompile()
        repropagate(gm, ctx.compute, ctx.device_type or "cpu")  # the next rewrites read the layers' bf16 outputs' dtypes
        return done

    return rewrite
