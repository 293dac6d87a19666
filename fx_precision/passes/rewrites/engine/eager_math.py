"""Op class ``eager-math``: reductions and transcendentals by torch's eager kernels, as the engine runs them.

mean / sum / pow / exp / log / cos / sin / tanh / sigmoid / erf / silu / gelu on a float tensor
->  fxp_engine.eager_math(x, op, dims, keepdim, exponent)       Inductor would sum in another order and
F.layer_norm                                                    approximate exp, cos, sin otherwise
->  fxp_engine.eager_layer_norm(...)
rsqrt stays Inductor's: its code and torch's eager kernel are both IEEE 1 / sqrt(x) (a test holds this).
A compiled engine (contract.inductor) runs all of it in its Inductor graph but its rotary tables (cos, sin,
computed eagerly when it loads): only those are rewritten, the rest is left to the training side's Inductor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import node_dtype, node_value
from fx_precision.passes.rewrites.engine.common import EngineRewrite, RewriteFn, record, replace_node

EAGER_MATH = OpClass.EAGER_MATH
COMPILED_ENGINE_EAGER = frozenset({"cos", "sin"})  # what a compiled engine still runs eagerly: its rotary tables, at load
_F = torch.nn.functional
# rsqrt stays Inductor's: its code and torch's eager kernel both compute 1 / sqrt(x) with IEEE division and
# square root (at::vec rsqrt, or `1 / std::sqrt` on a tail; Inductor builds with -fno-unsafe-math-optimizations),
# so they are the same correctly rounded ops, bit for bit (a test holds this), and the norm keeps one fusion.
_EAGER_FUNCTIONS: dict[Callable[..., object], str] = {
    torch.mean: "mean", torch.sum: "sum", torch.exp: "exp", torch.log: "log", torch.cos: "cos", torch.sin: "sin",
    torch.tanh: "tanh", torch.sigmoid: "sigmoid", torch.erf: "erf", torch.pow: "pow", _F.silu: "silu", _F.gelu: "gelu",
}  # fmt: skip
_EAGER_METHODS = frozenset({"mean", "sum", "exp", "log", "cos", "sin", "tanh", "sigmoid", "erf", "pow"})


def _eager_math_call(node: fx.Node) -> tuple[fx.Node, str, list[int], bool, float] | None:
    """(input, op, dims, keepdim, exponent) of a reduction or transcendental the contract keeps eager, or
    None where the call is not one (integer tensors, ``dtype=``/``out=`` forms, integer powers: exact anyway)."""
    if node.op == "call_method" and node.target in _EAGER_METHODS:
        op = str(node.target)
    elif node.op == "call_function" and node.target in _EAGER_FUNCTIONS:
        op = _EAGER_FUNCTIONS[node.target]
    else:
        return None
    x = node.args[0] if node.args else node.kwargs.get("input")
    value = node_value(x) if isinstance(x, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not isinstance(node_value(node), torch.Tensor):
        return None
    rest, kwargs = list(node.args[1:]), dict(node.kwargs)
    kwargs.pop("input", None)
    dims: list[int] = []
    keepdim, exponent = False, 1.0
    if op in ("mean", "sum"):
        dim = rest.pop(0) if rest else kwargs.pop("dim", None)
        keepdim = bool(rest.pop(0) if rest else kwargs.pop("keepdim", False))
        if dim is not None:
            dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (tuple, list)) else [None]  # type: ignore[list-item]
        if any(not isinstance(d, int) for d in dims) or (dim is not None and not dims):
            return None
    elif op == "pow":
        power = rest.pop(0) if rest else kwargs.pop("exponent", None)
        if not isinstance(power, float) or float(power).is_integer():
            return None  # x ** 2 is x * x in both
        exponent = power
    elif op == "gelu":
        approximate = rest.pop(0) if rest else kwargs.pop("approximate", "none")
        if approximate not in ("none", "tanh"):
            return None
        op = "gelu_tanh" if approximate == "tanh" else "gelu"
    elif op == "silu":
        kwargs.pop("inplace", None)
        rest = rest[1:] if rest and rest[0] is False else rest
    if rest or kwargs or not isinstance(x, fx.Node):
        return None
    return x, op, dims, keepdim, exponent


def _at_traced_dtype(gm: fx.GraphModule, x: fx.Node, node: fx.Node) -> fx.Node:
    """``x`` cast to the dtype ``node`` computed in when traced: autocast runs some of these ops in fp32
    (layer_norm on CPU, exp / sum / pow on CUDA), and a custom op is outside autocast's lists."""
    want, have = node_dtype(node), node_dtype(x)
    if want is None or have is None or want == have:
        return x
    return gm.graph.call_method("to", (x, want))


def _eager_layer_norm(gm: fx.GraphModule, node: fx.Node) -> list[EngineRewrite]:
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    x, shape = bound.get("input"), bound.get("normalized_shape")
    eps = bound.get("eps", 1e-5)
    if not isinstance(x, fx.Node) or not isinstance(shape, (tuple, list, int)) or not isinstance(eps, float):
        return []
    dims = [shape] if isinstance(shape, int) else list(shape)

    def build() -> fx.Node:
        weight, bias = (_at_traced_dtype(gm, t, node) if isinstance(t, fx.Node) else t for t in (bound.get("weight"), bound.get("bias")))
        operand = _at_traced_dtype(gm, x, node)
        return gm.graph.call_function(torch.ops.fxp_engine.eager_layer_norm.default, (operand, dims, weight, bias, eps))

    example = node.meta.get("example_value")
    made = replace_node(gm.graph, node, build, EAGER_MATH)
    made.meta["example_value"] = example
    return [record(EAGER_MATH, made, x, "layer_norm by torch's eager kernel, as the engine runs it")]


def _eager_call(gm: fx.GraphModule, x: fx.Node, node: fx.Node, op: str, dims: list[int], keepdim: bool, exponent: float) -> fx.Node:
    return gm.graph.call_function(torch.ops.fxp_engine.eager_math.default, (_at_traced_dtype(gm, x, node), op, dims, keepdim, exponent))


def engine_eager_math(contract: EngineContract) -> RewriteFn:
    """Every reduction (mean, sum) and transcendental (exp, cos, sin, silu, ...) on a float tensor becomes
    ``fxp_engine.eager_math``: the engine runs them as torch's eager kernels (its norms' mean of squares,
    its rotary tables, its activations), while Inductor would generate another summation order and other
    exp / cos / sin approximations. Under the ``aot_eager`` inner compiler the op is the same kernel. torch's eager
    kernels sum a reduction in its vector width's order: this process must run them at the engine's ATen capability
    (``contract.eager_math``), or the graph is refused."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        here = torch.backends.cpu.get_cpu_capability()
        if contract.eager_math is not None and here.lower() != contract.eager_math.lower():
            raise PrecisionError(
                f"engine contract: eager-math: the engine ran torch's eager kernels (its norms' sums, its activations) at "
                f"{contract.eager_math} and this process runs them at {here}, which sums and rounds otherwise: start the training "
                f"side with ATEN_CPU_CAPABILITY={contract.eager_math.lower()}"
            )
        done = []
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is _F.layer_norm and contract.inductor is None:
                done += _eager_layer_norm(gm, node)
                continue
            call = _eager_math_call(node)
            if call is None:
                continue
            x, op, dims, keepdim, exponent = call
            if contract.inductor is not None and op not in COMPILED_ENGINE_EAGER:
                continue  # the compiled engine runs it in its Inductor graph, as the training side's Inductor will
            example = node.meta.get("example_value")
            build = functools.partial(_eager_call, gm, x, node, op, dims, keepdim, exponent)
            made = replace_node(gm.graph, node, build, EAGER_MATH)
            made.meta["example_value"] = example
            done.append(record(EAGER_MATH, made, x, f"{op} by torch's eager kernel, as the engine runs it"))
        if done:
            gm.recompile()
        return done

    return rewrite
