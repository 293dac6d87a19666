"""The engine contract as graph rewrites: the training graph computes what the rollout engine computes.

Patterns are found by what the ops do, never by module names, so every architecture with the pattern
is covered (Llama, Qwen2/3, Mistral, Phi-3, Granite, ...)::

    fused add + norm   x32 = (a + b).to(fp32), feeding x32.pow(2).mean(-1)       (a, b narrow)
                   ->  x32 = a.to(fp32) + b.to(fp32)       the norm sees the unrounded sum, as vLLM's
                                                             fused_add_rms_norm; the stream keeps a + b
    rotary             (x * cos) + (cat(-x[..., h:], x[..., :h]) * sin)
                   ->  cat(x1*c - x2*s, x2*c + x1*s) in fp32   bf16 operands (exact products), one store:
                       .to(bf16)                            nearest-even in the graph, truncation by
                                                             fxp_engine.rotary
    attention          scaled_dot_product_attention(q, k, v, attn_mask, scale, is_causal)
                   ->  fxp_engine.attention(...)            the engine kernel's arithmetic (contract/ops.py)
    linears            linear(x, w, b)
                   ->  fxp_engine.linear(x, w, b, ...)      every row summed in the order of the engine call
                                                             that computed it (the engine's GEMM blocks K by
                                                             the rows of a call: contract/linear_order.py)
    eager math         mean / sum / exp / cos / sin / silu / ... on a float tensor
                   ->  fxp_engine.eager_math(x, op, ...)    torch's eager kernel: Inductor sums in another
                                                             order and approximates exp, cos, sin otherwise

Each is a ``GraphRewrite`` (pipeline step 5, after the precision fix made the stream narrow). The
custom ops keep Inductor from fusing the contract's fp32 math in another order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import GraphRewrite, PassContext
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind
from fx_precision.passes.graph.nodes import module_path, node_dtype, node_value, source_line

_SDPA = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_ADD = {operator.add, torch.add, operator.iadd}
_MUL = {operator.mul, torch.mul}


def _is(node: object, targets: set[Callable[..., object]] | Callable[..., object], method: str | None = None) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return method is not None and node.target == method
    wanted = targets if isinstance(targets, set) else {targets}
    return node.op == "call_function" and node.target in wanted


def _copy_meta(new: fx.Node, like: fx.Node) -> None:
    new.meta["nn_module_stack"] = dict(like.meta.get("nn_module_stack") or {})
    new.meta["stack_trace"] = like.meta.get("stack_trace")


def _record(node: fx.Node, of: fx.Node, what: str) -> InsertedCast:
    value = node_value(of)
    dtype = value.dtype if isinstance(value, torch.Tensor) else torch.bfloat16
    return InsertedCast(node.name, of.name, dtype, dtype, what, module_path(of), kind=CastKind.ENGINE)


# ---------------------------------------------------------------------------------------------
# fused add + norm
# ---------------------------------------------------------------------------------------------


def _widening_cast_of_add(node: fx.Node) -> fx.Node | None:
    """The ``add`` a node widens to fp32 (``.to(torch.float32)``, ``.float()``), when both its operands are narrow."""
    if node.op != "call_method" or node.target not in ("to", "float") or not node.args or node_dtype(node) != torch.float32:
        return None
    source = node.args[0]
    if not _is(source, _ADD, "add") or len(source.all_input_nodes) != 2:
        return None
    if any(node_dtype(a) not in (torch.bfloat16, torch.float16) for a in source.all_input_nodes):
        return None
    return source


def _feeds_mean_of_squares(node: fx.Node) -> bool:
    for user in node.users:
        squared = (_is(user, torch.pow, "pow") and user.args[1:2] == (2,)) or (_is(user, _MUL, "mul") and user.args[:2] == (node, node))
        if squared and any(_is(u, torch.mean, "mean") for u in user.users):
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


def fuse_add_norm(gm: fx.GraphModule, ctx: PassContext) -> list[InsertedCast]:
    """The norm after a residual add normalises the fp32 sum of the two bf16 operands, the stream keeps
    their rounded sum (the engine's fused add + norm). Three forms::

        in one graph         (a + b).to(fp32) -> norm         ->  a.to(fp32) + b.to(fp32) -> norm
        the add leaves       s = a + b  -> graph output       ->  s = fxp_engine.residual_add(a, b)
        the norm's input     x (an input).to(fp32) -> norm    ->  fxp_engine.unrounded_residual(x)
          comes in

    The last two meet across a graph break (an FSDP2 unit boundary, blocks compiled one by one): the
    sum kept by the first graph is the one the second normalises."""
    done = []
    graph = gm.graph
    for node in list(graph.nodes):
        add = _widening_cast_of_add(node)
        if add is not None and _feeds_mean_of_squares(node):
            with graph.inserting_before(node):
                left, right = (graph.call_method("to", (operand, torch.float32)) for operand in add.all_input_nodes)
                total = graph.call_function(operator.add, (left, right))
            for new in (left, right, total):
                _copy_meta(new, node)
            node.replace_all_uses_with(total)
            graph.erase_node(node)
            done.append(
                _record(
                    total, add, "fused add + norm: the norm normalises the fp32 sum of the residual add (the stream keeps the rounded sum)"
                )
            )
        elif _widening_cast(node) and _placeholder_through_views(node.args[0]) and _feeds_mean_of_squares(node):
            with graph.inserting_before(node):
                exact = graph.call_function(torch.ops.fxp_engine.unrounded_residual.default, (node.args[0],))
            _copy_meta(exact, node)
            node.replace_all_uses_with(exact)
            graph.erase_node(node)
            done.append(_record(exact, exact, "fused add + norm across a graph break: the norm takes the fp32 sum the add kept"))
    for node in list(graph.nodes):
        if _is(node, _ADD, "add") and _narrow_pair(node) and _reaches_output(node) and node.op == "call_function":
            with graph.inserting_before(node):
                kept = graph.call_function(torch.ops.fxp_engine.residual_add.default, tuple(node.args[:2]))
            _copy_meta(kept, node)
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            done.append(_record(kept, kept, "a residual sum leaving the graph: the fp32 sum kept for the next graph's norm"))
    if done:
        gm.recompile()
    return done


def _widening_cast(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in ("to", "float") and bool(node.args) and node_dtype(node) == torch.float32


def _narrow_pair(node: fx.Node) -> bool:
    operands = node.args[:2]
    if len(operands) != 2 or not all(isinstance(a, fx.Node) for a in operands) or node.kwargs:
        return False
    dtypes = {node_dtype(a) for a in operands}
    shapes = [node_value(a).shape if isinstance(node_value(a), torch.Tensor) else None for a in operands]
    return len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16} and shapes[0] is not None and shapes[0] == shapes[1]


# ---------------------------------------------------------------------------------------------
# rotary
# ---------------------------------------------------------------------------------------------


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
    if not _is(node, torch.cat):
        return None
    parts = node.args[0] if node.args else None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    value = node_value(node)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(value, torch.Tensor) or dim not in (-1, value.dim() - 1):
        return None
    neg, first = parts
    if not _is(neg, {operator.neg, torch.neg}, "neg"):
        return None
    second = neg.args[0]
    base = second.args[0] if isinstance(second, fx.Node) and second.args else None
    if isinstance(base, fx.Node) and _half(second, base, first=False) and _half(first, base, first=True):
        return base
    return None


def _rotary_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(x, cos, sin) when ``node`` is ``x * cos + rotate_half(x) * sin`` (either order)."""
    if not _is(node, _ADD, "add") or len(node.args) < 2:
        return None
    for plain, turned in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (_is(plain, _MUL, "mul") and _is(turned, _MUL, "mul")):
            continue
        for rot, sin in ((turned.args[0], turned.args[1]), (turned.args[1], turned.args[0])):
            x = _rotate_half_of(rot)
            if x is None:
                continue
            for base, cos in ((plain.args[0], plain.args[1]), (plain.args[1], plain.args[0])):
                if base is x and isinstance(cos, fx.Node) and isinstance(sin, fx.Node):
                    return x, cos, sin
    return None


ENGINE_MADE = "fxp_engine_made"  # node meta: a node a contract rewrite wrote (the coverage check skips it)


def _rotation(gm: fx.GraphModule, x: fx.Node, cos: fx.Node, sin: fx.Node, rounding: int) -> tuple[fx.Node, list[fx.Node]]:
    """The engine kernel's rotation written into the graph: ``x1*c - x2*s | x2*c + x1*s`` in fp32 from bf16
    operands (c, s: the first halves of cos, sin), one store to bf16. Each product of two bf16 values is exact
    in fp32, so whatever Inductor fuses or contracts into a multiply-add, the one rounding is the sum's: the
    same bits as the engine, and Inductor keeps the rotation in the kernel around it. A truncating store is
    the custom op (``fxp_engine.rotary``)."""
    graph = gm.graph
    created: list[fx.Node] = []

    def call(target: object, *args: object, method: bool = False) -> fx.Node:
        made = graph.call_method(target, args) if method else graph.call_function(target, args)  # type: ignore[arg-type]
        created.append(made)
        return made

    c16, s16 = call("to", cos, torch.bfloat16, method=True), call("to", sin, torch.bfloat16, method=True)
    if rounding != 0:
        return call(torch.ops.fxp_engine.rotary.default, x, c16, s16, rounding), created
    width = node_value(x).shape[-1]  # type: ignore[union-attr]
    half = width // 2
    x32, c32, s32 = (call("float", t, method=True) for t in (x, c16, s16))
    first, second = (Ellipsis, slice(None, half)), (Ellipsis, slice(half, None))
    x1, x2 = call(operator.getitem, x32, first), call(operator.getitem, x32, second)
    c, s = call(operator.getitem, c32, first), call(operator.getitem, s32, first)
    low = call(operator.sub, call(operator.mul, x1, c), call(operator.mul, x2, s))
    high = call(operator.add, call(operator.mul, x2, c), call(operator.mul, x1, s))
    out = graph.call_function(torch.cat, ((low, high),), {"dim": -1})
    created.append(out)
    return call("to", out, torch.bfloat16, method=True), created


def engine_rotary(contract: EngineContract) -> Callable[[fx.GraphModule, PassContext], list[InsertedCast]]:
    from fx_precision.contract.ops import ROUNDING_CODE

    rounding = ROUNDING_CODE[contract.rounding]

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[InsertedCast]:
        done = []
        for node in list(gm.graph.nodes):
            parts = _rotary_parts(node)
            if parts is None:
                continue
            x, cos, sin = parts
            if node_dtype(x) != torch.bfloat16:
                raise PrecisionError(
                    f"engine contract: rotary at {module_path(node) or '<root>'} ({source_line(node) or node.name}) rotates a "
                    f"{dtype_name(node_dtype(x))} tensor; the engine's kernel takes bf16. Run under bf16 autocast with bf16 gathers"
                )
            with gm.graph.inserting_before(node):
                new, created = _rotation(gm, x, cos, sin, rounding)
            for made in created:
                _copy_meta(made, node)
                made.meta[ENGINE_MADE] = "rotary"
            node.replace_all_uses_with(new)
            done.append(_record(new, x, f"rotary as the engine's kernel: fp32 math, one {contract.rounding} store"))
        if done:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return done

    return rewrite


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def _sdpa_arguments(node: fx.Node) -> dict[str, object]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def engine_attention(contract: EngineContract) -> Callable[[fx.GraphModule, PassContext], list[InsertedCast]]:
    from fx_precision.contract.ops import variant_codes

    variant = variant_codes(contract.attention)

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[InsertedCast]:
        done = []
        for node in list(gm.graph.nodes):
            if not _is(node, _SDPA):
                continue
            a = _sdpa_arguments(node)
            q, k, v = a["query"], a["key"], a["value"]
            where = f"{module_path(node) or '<root>'} ({source_line(node) or node.name})"
            if a.get("dropout_p", 0.0) not in (0, 0.0):
                raise PrecisionError(
                    f"engine contract: attention at {where} has dropout; the engine runs none (model.eval(), or dropout 0)"
                )
            qv = node_value(q)
            if not isinstance(qv, torch.Tensor) or qv.dim() != 4:
                raise PrecisionError(f"engine contract: attention at {where} is not [batch, heads, tokens, head_dim]; not followed")
            scale = a.get("scale")
            scale = float(scale) if scale is not None else float(qv.shape[-1]) ** -0.5
            graph = gm.graph
            with graph.inserting_before(node):
                qt, kt, vt = (graph.call_method("transpose", (t, 1, 2)) for t in (q, k, v))
                lens = graph.call_function(torch.full, ((qv.shape[0],), node_value(k).shape[2]), {"dtype": torch.int64})
                out = graph.call_function(
                    torch.ops.fxp_engine.attention.default,
                    (qt, kt, vt, lens, a.get("attn_mask"), scale, bool(a.get("is_causal", False)), -1, 0, variant),
                )
                back = graph.call_method("transpose", (out, 1, 2))
            for created in (qt, kt, vt, lens, out, back):
                _copy_meta(created, node)
            node.replace_all_uses_with(back)
            graph.erase_node(node)
            done.append(_record(out, q, f"attention as the engine's kernel: {contract.attention.describe()}"))
        if done:
            gm.recompile()
        return done

    return rewrite


# ---------------------------------------------------------------------------------------------
# linears that switch kernels on small batches
# ---------------------------------------------------------------------------------------------

_PASS_THROUGH = ("to", "float", "view", "reshape", "contiguous", "transpose", "permute", "squeeze", "unsqueeze")


def _reaches_output(node: fx.Node) -> bool:
    """The value leaves the graph, through views, slices and casts only (the logits)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output":
                return True
            if (user.op == "call_method" and user.target in _PASS_THROUGH) or (
                user.op == "call_function" and user.target is operator.getitem
            ):
                stack.append(user)
    return False


_LINEAR = {torch.nn.functional.linear, torch._C._nn.linear}


@dataclass(frozen=True)
class LinearForm:
    """One linear of a graph, however the model wrote it: ``out`` (the node whose value is x @ W^T + b), the input,
    the weight as [N, K] (``transposed``: the graph holds it as [K, N]), the bias, the nodes it replaces."""

    out: fx.Node
    x: fx.Node
    weight: fx.Node
    transposed: bool
    bias: fx.Node | None
    replaced: tuple[fx.Node, ...]


_CASTS = ("to", "float", "bfloat16", "half", "type_as")


def _weight(node: object) -> bool:
    """A 2-d float parameter of a module, or a cast of one (the gather emulation casts masters at their use)."""
    value = node_value(node) if isinstance(node, fx.Node) else None
    if not (isinstance(node, fx.Node) and isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()):
        return False
    while node.op == "call_method" and node.target in _CASTS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    lifted = node.op == "placeholder" and "_parameters_" in str(node.target)  # Dynamo's name for a module's parameter
    return lifted or node.op == "get_attr" or isinstance(node_value(node), torch.nn.Parameter)


def _transposed_weight(node: object) -> fx.Node | None:
    """``w`` when ``node`` is ``w.T``, ``w.t()`` or ``w.transpose(0, 1)`` of a 2-d weight."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    base = node.args[0]
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("T",) and _weight(base):
        return base  # type: ignore[return-value]
    if node.op == "call_method" and node.target == "t" and _weight(base):
        return base  # type: ignore[return-value]
    if node.op == "call_method" and node.target == "transpose" and set(node.args[1:]) in ({0, 1}, {-1, -2}) and _weight(base):
        return base  # type: ignore[return-value]
    return None


def _bias_of(node: fx.Node, width: int) -> tuple[fx.Node, fx.Node] | None:
    """(the add, the bias) when a product's only use is ``+ b`` with a 1-d bias of its width (FalconLinear)."""
    users = list(node.users)
    if len(users) != 1 or not _is(users[0], _ADD, "add") or len(users[0].args) != 2 or users[0].kwargs:
        return None
    add = users[0]
    other = add.args[1] if add.args[0] is node else add.args[0]
    value = node_value(other) if isinstance(other, fx.Node) else None
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == width and isinstance(other, fx.Node):
        return add, other
    return None


def linear_forms(gm: fx.GraphModule) -> list[LinearForm]:
    """Every linear of the graph: ``F.linear(x, w, b)``, ``x @ w.T`` (+ b), ``addmm(b, x, w)`` (GPT-2's Conv1D)."""
    forms = []
    for node in gm.graph.nodes:
        linear = _is(node, _LINEAR) and len(node.args) >= 2 and isinstance(node.args[0], fx.Node)
        if linear and isinstance(node_value(node.args[1]), torch.Tensor):
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            forms.append(LinearForm(node, node.args[0], node.args[1], False, bias if isinstance(bias, fx.Node) else None, (node,)))
        elif _is(node, {torch.matmul, operator.matmul}, "matmul") and len(node.args) == 2 and isinstance(node.args[0], fx.Node):
            weight = _transposed_weight(node.args[1])
            if weight is None:
                continue
            width = node_value(weight).shape[0]  # type: ignore[union-attr]
            added = _bias_of(node, width)
            if added is not None:
                forms.append(LinearForm(added[0], node.args[0], weight, False, added[1], (added[0], node)))
            else:
                forms.append(LinearForm(node, node.args[0], weight, False, None, (node,)))
        elif _is(node, {torch.addmm}, "addmm") and len(node.args) == 3 and not node.kwargs and _weight(node.args[2]):
            bias, x = node.args[0], node.args[1]
            if isinstance(x, fx.Node) and isinstance(bias, fx.Node) and getattr(node_value(bias), "dim", lambda: 0)() == 1:
                forms.append(LinearForm(node, x, node.args[2], True, bias, (node,)))  # type: ignore[arg-type]
    return forms


def _engine_width(form: LinearForm, forms: list[LinearForm]) -> int:
    """The output width of the engine GEMM this linear may be part of: engines fuse the linears that read one input
    (q, k and v into qkv; gate and up into gate_up), so their summed width (0 where it reads its input alone). The op
    falls back to the linear's own width where the engine read no call of the summed one (parallel blocks)."""
    siblings = [f for f in forms if f.x is form.x]
    if len(siblings) < 2:
        return 0
    widths = [node_value(f.weight).shape[1 if f.transposed else 0] for f in siblings]  # type: ignore[union-attr]
    return int(sum(widths))


def engine_linears(contract: EngineContract) -> Callable[[fx.GraphModule, PassContext], list[InsertedCast]]:
    """Every linear becomes ``fxp_engine.linear``: each row summed in the order of the engine call that computed it
    (the output projection's rows by the logits calls, every other linear's by the forward steps)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[InsertedCast]:
        done = []
        forms = linear_forms(gm)
        if forms and not contract.linears.calls:
            where = module_path(forms[0].out) or "<root>"
            raise PrecisionError(
                f"engine contract ({contract.engine} {contract.version or ''}): the graph computes linears ({where}, ...) and the "
                "contract holds no summation order for any engine linear call (its rollout read none, or predates them): the "
                "engine's GEMM sums in an order that depends on each call's rows, which a contract must read off the engine. "
                "Roll out again with fx-precision rollout of this version"
            )
        widths = [_engine_width(f, forms) for f in forms]
        graph = gm.graph
        for form, width in zip(forms, widths, strict=True):
            logits = _reaches_output(form.out)
            with graph.inserting_before(form.out):
                weight = graph.call_method("t", (form.weight,)) if form.transposed else form.weight
                casts = [graph.call_method("to", (t, torch.bfloat16)) for t in (form.x, weight)]
                b = graph.call_method("to", (form.bias, torch.bfloat16)) if form.bias is not None else None
                new = graph.call_function(
                    torch.ops.fxp_engine.linear.default, (casts[0], casts[1], b, logits, width, module_path(form.out))
                )
            made = [*casts, *([b] if b is not None else []), *([weight] if form.transposed else []), new]
            for created in made:
                _copy_meta(created, form.out)
            form.out.replace_all_uses_with(new)
            for old in form.replaced:
                graph.erase_node(old)
            role = "the logits" if logits else "a body linear"
            fused = f" (part of the engine's {width}-wide GEMM)" if width else ""
            done.append(_record(new, form.x, f"{role}{fused}: each row summed in the order of the engine call that computed it"))
        if done:
            graph.eliminate_dead_code()
            gm.recompile()
        return done

    return rewrite


# ---------------------------------------------------------------------------------------------
# what the contract does not follow
# ---------------------------------------------------------------------------------------------

_MATMUL = {torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, operator.matmul}
_MATMUL_METHODS = ("matmul", "bmm", "baddbmm")
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}
_SHAPING = {torch.stack, torch.cat, torch.flatten}
_SHAPING_METHODS = ("flatten", "view", "reshape", "contiguous")


def _near(node: fx.Node, wanted: Callable[[fx.Node], bool], hops: int, upward: bool) -> bool:
    frontier = [node]
    for _ in range(hops):
        frontier = [n for f in frontier for n in (f.all_input_nodes if upward else f.users)]
        if any(wanted(n) for n in frontier):
            return True
    return False


def _eager_attention(node: fx.Node) -> bool:
    """A softmax over scores a matmul of two activations made a few ops before (q @ k^T, not a router's linear)."""
    is_softmax = _is(node, _SOFTMAX, "softmax")
    return is_softmax and _near(
        node, lambda n: _is(n, _MATMUL) or (n.op == "call_method" and n.target in _MATMUL_METHODS), hops=6, upward=True
    )


def _rotation_left(node: fx.Node) -> bool:
    """A rotary the rotary rewrite did not take: a negation multiplied after a stack / cat (rotate-half in
    another layout), or a cat of ``x1*c - x2*s`` with its partner (the rotation written out, as MLA does)."""
    if _is(node, {operator.neg, torch.neg}, "neg"):
        stack, shaped = list(node.users), False
        for _ in range(4):
            nxt = []
            for user in stack:
                if _is(user, _MUL, "mul") and shaped:
                    return True
                if _is(user, _SHAPING) or (user.op == "call_method" and user.target in _SHAPING_METHODS):
                    shaped = True
                    nxt.extend(user.users)
            stack = nxt
        return False
    if _is(node, {torch.cat, torch.stack}) and node.args and isinstance(node.args[0], (list, tuple)):
        parts = [p for p in node.args[0] if isinstance(p, fx.Node)]
        return any(
            _is(p, {operator.sub, torch.sub}, "sub") and all(_is(a, _MUL, "mul") for a in p.all_input_nodes) and len(p.all_input_nodes) == 2
            for p in parts
        )
    return False


def _weight_gemm(node: fx.Node) -> bool:
    """A matrix product with a weight operand that the linear rewrite left (another form than it takes)."""
    gemm = _is(node, {*_MATMUL, torch.mm, torch.addmm}) or (node.op == "call_method" and node.target in (*_MATMUL_METHODS, "mm"))
    return gemm and any(_weight(a) or _transposed_weight(a) is not None for a in node.args if isinstance(a, fx.Node))


def engine_coverage(contract: EngineContract) -> Callable[[fx.GraphModule, PassContext], list[InsertedCast]]:
    """Refuse a graph that still computes what the engine runs with kernels the contract does not
    follow: eager softmax attention (soft-capping, ALiBi), interleaved or written-out rotary, MoE
    routing (the engine's fused experts), linear-attention convolutions. The contract would be silently
    broken there, and the comparison would only say so after a rollout."""

    def check(gm: fx.GraphModule, ctx: PassContext) -> list[InsertedCast]:
        left = []
        for node in gm.graph.nodes:
            if _eager_attention(node):
                left.append(f"attention computed as matmul + softmax at {module_path(node) or '<root>'} ({source_line(node) or node.name})")
            elif _weight_gemm(node):
                left.append(f"a linear written as {node.target} at {module_path(node) or '<root>'} ({source_line(node) or node.name}): "
                            "the engine's GEMM order is followed for F.linear, x @ w.T and addmm only")  # fmt: skip
            elif _is(node, {torch.topk}, "topk"):
                where = module_path(node) or "<root>"
                left.append(f"mixture-of-experts routing (topk) at {where}: the engine's fused-experts kernel is not followed")
            elif _is(node, {torch.conv1d, torch.nn.functional.conv1d}):
                where = module_path(node) or "<root>"
                left.append(f"a causal convolution (a linear-attention layer) at {where}: the engine's kernel is not followed")
            elif contract.rotary == "kernel" and ENGINE_MADE not in node.meta and _rotation_left(node):
                left.append(
                    f"a rotary the contract does not follow (interleaved pairs, or rotated in fp32) at "
                    f"{module_path(node) or '<root>'} ({source_line(node) or node.name})"
                )
        if left:
            more = f" (and {len(left) - 3} more)" if len(left) > 3 else ""
            raise PrecisionError(
                f"engine contract ({contract.describe()}) cannot be kept on this graph: "
                + "; ".join(left[:3])
                + more
                + ". The contract follows dense decoders: scaled_dot_product_attention (attn_implementation='sdpa'), half-split "
                "(neox) rotary on bf16 tensors, dense MLPs; compare without --contract to see the gap"
            )
        return []

    return check


# ---------------------------------------------------------------------------------------------
# eager math: reductions and transcendental functions by torch's eager kernels
# ---------------------------------------------------------------------------------------------

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
        op = _EAGER_FUNCTIONS[node.target]  # type: ignore[index]
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
    if rest or kwargs:
        return None
    return x, op, dims, keepdim, exponent


def _at_traced_dtype(gm: fx.GraphModule, x: fx.Node, node: fx.Node) -> fx.Node:
    """``x`` cast to the dtype ``node`` computed in when traced: autocast runs some of these ops in fp32
    (layer_norm on CPU, exp / sum / pow on CUDA), and a custom op is outside autocast's lists."""
    want, have = node_dtype(node), node_dtype(x)
    if want is None or have is None or want == have:
        return x
    cast = gm.graph.call_method("to", (x, want))
    _copy_meta(cast, node)
    return cast


def _eager_layer_norm(gm: fx.GraphModule, node: fx.Node) -> list[InsertedCast]:
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    x, shape = bound.get("input"), bound.get("normalized_shape")
    eps = bound.get("eps", 1e-5)
    if not isinstance(x, fx.Node) or not isinstance(shape, (tuple, list, int)) or not isinstance(eps, float):
        return []
    shape = [shape] if isinstance(shape, int) else list(shape)
    with gm.graph.inserting_before(node):
        weight, bias = (_at_traced_dtype(gm, t, node) if isinstance(t, fx.Node) else t for t in (bound.get("weight"), bound.get("bias")))
        operand = _at_traced_dtype(gm, x, node)
        new = gm.graph.call_function(torch.ops.fxp_engine.eager_layer_norm.default, (operand, shape, weight, bias, eps))
    _copy_meta(new, node)
    new.meta["example_value"] = node.meta.get("example_value")
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return [_record(new, x, "layer_norm by torch's eager kernel, as the engine runs it")]


def engine_eager_math(gm: fx.GraphModule, ctx: PassContext) -> list[InsertedCast]:
    """Every reduction (mean, sum) and transcendental (exp, cos, sin, silu, ...) on a float tensor becomes
    ``fxp_engine.eager_math``: the engine runs them as torch's eager kernels (its norms' mean of squares,
    its rotary tables, its activations), while Inductor would generate another summation order and other
    exp / cos / sin approximations. Under the ``aot_eager`` inner compiler the op is the same kernel."""
    done = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _F.layer_norm:
            done += _eager_layer_norm(gm, node)
            continue
        call = _eager_math_call(node)
        if call is None:
            continue
        x, op, dims, keepdim, exponent = call
        with gm.graph.inserting_before(node):
            operand = _at_traced_dtype(gm, x, node)
            new = gm.graph.call_function(torch.ops.fxp_engine.eager_math.default, (operand, op, dims, keepdim, exponent))
        _copy_meta(new, node)
        new.meta["example_value"] = node.meta.get("example_value")
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        done.append(_record(new, x, f"{op} by torch's eager kernel, as the engine runs it"))
    if done:
        gm.recompile()
    return done


def engine_rewrites(contract: EngineContract) -> list[GraphRewrite]:
    """The contract's rewrites, in the order they apply (norms, rotary, attention, linears, eager math), then the
    check that nothing the engine computes otherwise is left."""
    import fx_precision.contract.ops  # noqa: F401  (registers torch.ops.fxp_engine)

    rewrites = [GraphRewrite("fused-add-norm", fuse_add_norm)] if contract.norm == "fused-add" else []
    if contract.rotary == "kernel":
        rewrites.append(GraphRewrite("engine-rotary", engine_rotary(contract)))
    rewrites.append(GraphRewrite("engine-attention", engine_attention(contract)))
    rewrites.append(GraphRewrite("engine-linears", engine_linears(contract)))
    rewrites.append(GraphRewrite("engine-eager-math", engine_eager_math))
    rewrites.append(GraphRewrite("engine-coverage", engine_coverage(contract)))
    return rewrites
