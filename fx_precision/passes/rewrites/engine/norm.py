"""Op class ``norm``: the norm after a residual add normalises what the engine normalises.

fused-add   the fp32 sum of the two bf16 operands (vLLM's fused_add_rms_norm); the stream keeps their
            rounded sum. Three forms::

    in one graph         (a + b).to(fp32) -> norm         ->  a.to(fp32) + b.to(fp32) -> norm
    the add leaves       s = a + b  -> graph output       ->  s = fxp_engine.residual_add(a, b)
    the norm's input     x (an input).to(fp32) -> norm    ->  fxp_engine.unrounded_residual(x)
      comes in

            The last two meet across a graph break (an FSDP2 unit boundary, blocks compiled one by one):
            the sum kept by the first graph is the one the second normalises.
plain       the model's own rounded sum: nothing to rewrite
inductor    the compiled engine (vLLM's native forms through Inductor): Inductor drops a bf16 rounding inside a
            fused kernel, so the engine's residual stream stays fp32 from the embedding to the last norm, and a
            norm's ``x.to(bf16) * weight`` is one fp32 product stored once. Written into the graph, so Inductor
            fuses the training side the same way whatever it realises::

    s = a + b   (a residual add)               ->  s = a.to(fp32) + b.to(fp32)       (every later add is fp32 too)
    w * (x * rsqrt(mean(x**2) + eps)).to(bf16) ->  ((x * rsqrt(..)) * w.float()).to(bf16)
                                                   (UNROUNDED: the rotary reads the fp32 product, as the
                                                   engine's fused q / k norm and rotary do)
    mean(x ** 2, -1, keepdim=True)             ->  fxp_engine.inductor_sum_squares(x, weight) / size, where the
                                                   contract holds the engine's norm orders (FSDP2 units fuse a
                                                   norm otherwise: contract/inductor_norms.py)
    (inductor-stream: the model adds its residual itself, Granite)
    x * c  (bf16 stream term)                  ->  x.to(fp32) * c
    a norm's input x, where the engine's       ->  fxp_engine.inductor_stream(x, weight): normalised and carried on
      kernel stores it narrow                      rounded, its squares summed unrounded (Granite's stream, which
                                                   Inductor realises in bf16 every few layers)
unmatched   a graph with the pattern is refused with the probe's reason
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import NormForm, OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import module_path, node_dtype, node_value
from fx_precision.passes.rewrites.engine.common import (
    ADD,
    MUL,
    PASS_THROUGH,
    EngineRewrite,
    RewriteFn,
    constant_factor,
    is_call,
    reaches_output,
    record,
    replace_node,
)

NORM = OpClass.NORM
UNROUNDED = "fxp_unrounded"  # meta key of a norm's bf16 output (inductor form): the fp32 product it rounds
_NARROW = (torch.bfloat16, torch.float16)


def _widening_cast(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in ("to", "float") and bool(node.args) and node_dtype(node) == torch.float32


def _widening_cast_of_add(node: fx.Node) -> fx.Node | None:
    """The ``add`` a node widens to fp32 (``.to(torch.float32)``, ``.float()``), when both its operands are narrow."""
    if not _widening_cast(node):
        return None
    source = node.args[0]
    if not is_call(source, ADD, "add") or len(source.all_input_nodes) != 2:
        return None
    if any(node_dtype(a) not in (torch.bfloat16, torch.float16) for a in source.all_input_nodes):
        return None
    return source


def _feeds_mean_of_squares(node: fx.Node) -> bool:
    for user in node.users:
        power = is_call(user, torch.pow, "pow") and user.args[1:2] == (2,)
        squared = power or (is_call(user, MUL, "mul") and user.args[:2] == (node, node))
        if squared and any(is_call(u, torch.mean, "mean") for u in user.users):
            return True
    return False


def _placeholder_through_views(node: object) -> bool:
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return True
        if node.op == "call_method" and node.target in ("view", "reshape", "contiguous") and node.args:
            node = node.args[0]
        else:
            return False
    return False


def _narrow_pair(node: fx.Node) -> bool:
    operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    if len(operands) != 2 or node.kwargs:
        return False
    dtypes = {node_dtype(a) for a in operands}
    values = [node_value(a) for a in operands]
    shapes = [v.shape if isinstance(v, torch.Tensor) else None for v in values]
    return len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16} and shapes[0] is not None and shapes[0] == shapes[1]


def _fp32_sum(graph: fx.Graph, a: fx.Node, b: fx.Node) -> fx.Node:
    return graph.call_function(operator.add, (graph.call_method("to", (a, torch.float32)), graph.call_method("to", (b, torch.float32))))


def _narrowing(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "to" and node_dtype(node) in _NARROW


def _is_rms_scaling(node: fx.Node) -> bool:
    """``node`` is ``x * rsqrt(mean(x ** 2) + eps)`` (either order)."""
    if not is_call(node, MUL, "mul"):
        return False
    for r in node.args[:2]:
        added = r.args[0] if isinstance(r, fx.Node) and is_call(r, torch.rsqrt, "rsqrt") and r.args else None
        if isinstance(added, fx.Node) and is_call(added, ADD, "add") and any(is_call(a, torch.mean, "mean") for a in added.args):
            return True
    return False


def _weighted_norms(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(out, scaled, weight) of every ``out = weight * scaled.to(narrow)`` (either order) after an RMS scaling."""
    found = []
    for node in graph.nodes:
        if not is_call(node, MUL, "mul") or len(node.args) != 2 or node.kwargs:
            continue
        for cast, weight in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if isinstance(cast, fx.Node) and _narrowing(cast) and isinstance(weight, fx.Node) and len(cast.users) == 1:
                scaled = cast.args[0]
                if isinstance(scaled, fx.Node) and _is_rms_scaling(scaled):
                    found.append((node, scaled, weight))
                    break
    return found


def _scaling_weights(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(scaled, weight) of every RMS scaling in ``graph`` and the weight it is multiplied by, through a cast of any dtype
    (a norm whose input is fp32 already, say a unit's input under FSDP2, casts to fp32: no narrowing); refused where a
    scaling meets no weight (the engine's order is found by the weight)."""
    found = []
    for node in graph.nodes:
        if not _is_rms_scaling(node):
            continue
        users = [u for c in node.users for u in (c.users if c.op == "call_method" and c.target == "to" else (c,))]
        weights = [a for u in users if is_call(u, MUL, "mul") for a in u.args[:2]
                   if isinstance(a, fx.Node) and a is not node and a not in node.users]  # fmt: skip
        if len(weights) != 1:
            raise PrecisionError(f"engine contract: the norm at {module_path(node) or '<root>'} is multiplied by {len(weights)} weights: "
                                 "the compiled engine's norm order is followed for a weighted RMS norm (one weight); roll out with "
                                 "--launch eager for this model")  # fmt: skip
        found.append((node, weights[0]))
    return found


def _weight_source(weight: fx.Node) -> fx.Node:
    """The tensor a norm's weight operand reads: through casts and views (``PASS_THROUGH``) to the graph input (the
    module's parameter, or FSDP2's gathered one), which ``fxp_engine.inductor_sum_squares`` finds its norm by.
    A zero-centred weight (``1 + w.float()``: Qwen3-Next's, Gemma's norms) is read through its constant offset."""
    node = weight
    while True:
        if node.op == "call_method" and node.target in PASS_THROUGH and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if is_call(node, ADD, "add") and len(tensors) == 1 and any(isinstance(a, (int, float)) for a in node.args[:2]):
            node = tensors[0]
            continue
        return node


def _engine_ordered_sum(graph: fx.Graph, scaled: fx.Node, weight: fx.Node) -> EngineRewrite:
    """``mean(x ** 2, -1, keepdim=True)`` of the norm ``scaled`` -> ``inductor_sum_squares(x, weight) / size``: the
    compiled engine's summation order for this norm (contract/inductor_norms.py), looked up by its weight at run time."""
    added = [r.args[0] for r in scaled.args[:2] if isinstance(r, fx.Node) and is_call(r, torch.rsqrt, "rsqrt") and r.args]
    mean = next(a for n in added if isinstance(n, fx.Node) for a in n.args if isinstance(a, fx.Node) and is_call(a, torch.mean, "mean"))
    squared = mean.args[0]
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    x = squared.args[0] if isinstance(squared, fx.Node) and squared.args else None
    value = node_value(x) if isinstance(x, fx.Node) else None
    if dims not in (-1, [-1], (-1,)) or keep is not True or not isinstance(value, torch.Tensor):
        raise PrecisionError(f"engine contract: the norm at {module_path(scaled) or '<root>'} takes its mean over {dims!r} "
                             f"(keepdim={keep!r}): the compiled engine's norm order is followed for mean(x ** 2, -1, keepdim=True); "
                             "roll out with --launch eager for this model")  # fmt: skip
    size = int(value.shape[-1])
    source = _weight_source(weight)

    def build() -> fx.Node:
        summed = graph.call_function(torch.ops.fxp_engine.inductor_sum_squares.default, (x, source))
        return graph.call_function(operator.truediv, (summed, size))

    made = replace_node(graph, mean, build, NORM, erase=(mean,))
    return record(NORM, made, scaled, f"the norm's sum of squares in the compiled engine's order (over {size} values)")


def _narrow_times_constant(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(x, c) of a narrow ``x * c`` by a Python number (either order): Granite's multipliers."""
    for x in node.args[:2]:
        if isinstance(x, fx.Node) and node_dtype(x) in _NARROW and (c := constant_factor(node, x, divides=False)) is not None:
            return x, c
    return None


def _feeds_stream(node: fx.Node) -> bool:
    """``node`` is a term of the residual stream: an operand of an add of two tensors, or widened into a norm. (A scaled
    embedding the root's eager forward hands to the first FSDP2 unit is widened there: training_side's hooks step.)"""
    for user in node.users:
        if _widening_cast(user) and _feeds_mean_of_squares(user):
            return True
        if is_call(user, ADD, "add") and len([a for a in user.args[:2] if isinstance(a, fx.Node)]) == 2:
            return True
    return False


def _scaled_stream_terms(graph: fx.Graph) -> list[EngineRewrite]:
    """A model that scales a term of its stream by a constant in bf16 (Granite: ``embeds * embedding_multiplier``,
    ``residual + h * residual_multiplier``): the compiled engine's kernel multiplies the widened term in fp32, never
    rounding the product, as it adds it::

        x * c  (bf16, a stream term)   ->   x.to(fp32) * c
    """
    done = []
    for node in list(graph.nodes):
        found = _narrow_times_constant(node)
        if found is None or not _feeds_stream(node):
            continue
        x, c = found

        def build(x: fx.Node = x, c: float = c) -> fx.Node:
            return graph.call_function(operator.mul, (graph.call_method("to", (x, torch.float32)), c))

        made = replace_node(graph, node, build, NORM)
        done.append(record(NORM, made, node, "a scaled stream term in fp32, as the compiled engine's kernel multiplies it"))
    return done


def _stream_roundings(graph: fx.Graph, scalings: list[tuple[fx.Node, fx.Node]]) -> list[EngineRewrite]:
    """Where the engine's norm kernel stores its input narrow (``NormReduction.stores``): the norm normalises that
    rounding and the stream goes on from it, while its sum of squares takes the fp32 value::

        x = s.to(fp32); ... x * rsqrt(...); r = s (the residual)
            ->  xr = fxp_engine.inductor_stream(x, weight); ... xr * rsqrt(...); r = xr

    Decided at run time by the norm's weight (one graph Dynamo reuses for several layers rounds where each does)."""
    done = []
    stream = torch.ops.fxp_engine.inductor_stream.default
    for scaled, weight in scalings:
        x = next(a for a in scaled.args[:2] if isinstance(a, fx.Node) and not is_call(a, torch.rsqrt, "rsqrt"))
        source = x.args[0] if _widening_cast(x) and isinstance(x.args[0], fx.Node) else None
        with graph.inserting_after(x):
            rounded = graph.call_function(stream, (x, _weight_source(weight)))
        rounded.meta.update({k: v for k, v in x.meta.items() if k in ("nn_module_stack", "stack_trace")})
        scaled.replace_input_with(x, rounded)
        if source is not None:
            for user in [u for u in source.users if u is not x and u.op != "output"]:
                user.replace_input_with(source, rounded)
        done.append(record(NORM, rounded, scaled, "the norm's input as the engine's kernel leaves it (rounded where it stores it)"))
    return done


def _inductor_norms(gm: fx.GraphModule, contract: EngineContract) -> list[EngineRewrite]:
    """The inductor form (module docstring): the residual stream in fp32, each weighted norm one fp32 product."""
    graph = gm.graph
    done = _scaled_stream_terms(graph) if contract.norm == NormForm.INDUCTOR_STREAM else []
    if contract.norm == NormForm.INDUCTOR_STREAM and contract.norm_reductions is None:
        raise PrecisionError(
            "engine contract: the model adds its residual stream itself (Granite's residual + h * multiplier), which the "
            "compiled engine rounds only where its norm kernels store it, read off its generated code, and this contract "
            "holds no norm reductions; roll out again (the engine's compile cache readable), or with --launch eager"
        )
    fused = [add for n in graph.nodes if (add := _widening_cast_of_add(n)) is not None and _feeds_mean_of_squares(n)]
    leaving = [n for n in graph.nodes if n.op == "call_function" and is_call(n, ADD) and _narrow_pair(n) and reaches_output(n)]
    norms = _weighted_norms(graph)
    for add in dict.fromkeys(fused + leaving):
        a, b = (x for x in add.args[:2] if isinstance(x, fx.Node))  # _narrow_pair / _widening_cast_of_add: two nodes
        made = replace_node(graph, add, functools.partial(_fp32_sum, graph, a, b), NORM)
        done.append(record(NORM, made, add, "the residual stream in fp32, as the compiled engine keeps it"))
    if contract.norm_reductions is not None:  # each norm's sum of squares in the engine's order, whatever Inductor fuses here
        scalings = _scaling_weights(graph)
        for scaled, weight in scalings:
            done.append(_engine_ordered_sum(graph, scaled, weight))
        if any(r.stores is not None for r in contract.norm_reductions):
            done.extend(_stream_roundings(graph, scalings))
    for out, scaled, weight in norms:
        cast = next(a for a in out.args if isinstance(a, fx.Node) and a is not weight)
        narrow = node_dtype(cast) or torch.bfloat16  # the norm's input dtype, which the engine stores its output in

        def build(scaled: fx.Node = scaled, weight: fx.Node = weight, narrow: torch.dtype = narrow) -> fx.Node:
            product = graph.call_function(operator.mul, (scaled, graph.call_method("to", (weight, torch.float32))))
            stored = graph.call_method("to", (product, narrow))
            stored.meta[UNROUNDED] = product
            return stored

        example = out.meta.get("example_value")
        made = replace_node(graph, out, build, NORM, erase=(out, cast))
        if isinstance(example, torch.Tensor) and example.dtype == narrow:  # what later rewrites read of the node: same
            made.meta["example_value"] = example
        done.append(record(NORM, made, out, "the norm's fp32 product stored once, as the compiled engine's fused kernel"))
    if done:
        gm.recompile()
    return done


def fuse_add_norm(contract: EngineContract) -> RewriteFn:
    """The op class's rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        graph = gm.graph
        fused = [(n, add) for n in graph.nodes if (add := _widening_cast_of_add(n)) is not None and _feeds_mean_of_squares(n)]
        taken = [n for n in graph.nodes if _widening_cast(n) and _placeholder_through_views(n.args[0]) and _feeds_mean_of_squares(n)]
        leaving = [n for n in graph.nodes if n.op == "call_function" and is_call(n, ADD) and _narrow_pair(n) and reaches_output(n)]
        if contract.norm is None and (fused or taken):
            raise contract.refused(NORM, module_path(fused[0][0] if fused else taken[0]))
        if contract.norm in (NormForm.INDUCTOR, NormForm.INDUCTOR_STREAM):
            return _inductor_norms(gm, contract)
        if contract.norm != NormForm.FUSED_ADD:
            return []
        done = []
        for node, add in fused:
            made = replace_node(graph, node, functools.partial(_fp32_sum, graph, *add.all_input_nodes), NORM)
            done.append(record(NORM, made, add, "the norm normalises the fp32 sum of the residual add (the stream keeps its rounding)"))
        unrounded, kept = torch.ops.fxp_engine.unrounded_residual.default, torch.ops.fxp_engine.residual_add.default
        for node in taken:
            made = replace_node(graph, node, functools.partial(graph.call_function, unrounded, (node.args[0],)), NORM)
            done.append(record(NORM, made, made, "across a graph break: the norm takes the fp32 sum the residual add kept"))
        for node in leaving:
            made = replace_node(graph, node, functools.partial(graph.call_function, kept, tuple(node.args[:2])), NORM)
            done.append(record(NORM, made, made, "a residual sum leaving the graph: its fp32 sum kept for the next graph's norm"))
        if done:
            gm.recompile()
        return done

    return rewrite
