"""The linears of a graph, however the model wrote them: ``F.linear(x, w, b)``, ``x @ w.T`` (+ b), ``addmm(b, x, w)``.

    LinearForm      the node whose value is x @ W^T + b, its input, its weight as [N, K], its bias, what it replaces
    linear_forms    every linear of a graph
    weight_like     a 2-d float parameter of a module, or a cast of one (gathers are cast at their use)
    transposed_weight   ``w`` of ``w.T`` / ``w.t()`` / ``w.transpose(0, 1)``

A reader: the engine contract's linear rewrite and its coverage rule both read linears through it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from fx_precision.passes.graph.nodes import is_call, node_value

ADD = {operator.add, torch.add, operator.iadd}

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


def weight_like(node: object) -> bool:
    """A 2-d float parameter of a module, or a cast of one (the gather emulation casts masters at their use)."""
    value = node_value(node) if isinstance(node, fx.Node) else None
    if not (isinstance(node, fx.Node) and isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()):
        return False
    while node.op == "call_method" and node.target in _CASTS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    lifted = node.op == "placeholder" and "_parameters_" in str(node.target)  # Dynamo's name for a module's parameter
    return lifted or node.op == "get_attr" or isinstance(node_value(node), torch.nn.Parameter)


def transposed_weight(node: object) -> fx.Node | None:
    """``w`` when ``node`` is ``w.T``, ``w.t()`` or ``w.transpose(0, 1)`` of a 2-d weight."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    base = node.args[0]
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("T",) and weight_like(base):
        return base  # type: ignore[return-value]
    if node.op == "call_method" and node.target == "t" and weight_like(base):
        return base  # type: ignore[return-value]
    if node.op == "call_method" and node.target == "transpose" and set(node.args[1:]) in ({0, 1}, {-1, -2}) and weight_like(base):
        return base  # type: ignore[return-value]
    return None


def bias_of(node: fx.Node, width: int) -> tuple[fx.Node, fx.Node] | None:
    """(the add, the bias) when a product's only use is ``+ b`` with a 1-d bias of its width (FalconLinear)."""
    users = list(node.users)
    if len(users) != 1 or not is_call(users[0], ADD, "add") or len(users[0].args) != 2 or users[0].kwargs:
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
        linear = is_call(node, _LINEAR) and len(node.args) >= 2 and isinstance(node.args[0], fx.Node)
        if linear and isinstance(node_value(node.args[1]), torch.Tensor):
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            forms.append(LinearForm(node, node.args[0], node.args[1], False, bias if isinstance(bias, fx.Node) else None, (node,)))
        elif is_call(node, {torch.matmul, operator.matmul}, "matmul") and len(node.args) == 2 and isinstance(node.args[0], fx.Node):
            weight = transposed_weight(node.args[1])
            if weight is None:
                continue
            width = node_value(weight).shape[0]
            added = bias_of(node, width)
            if added is not None:
                forms.append(LinearForm(added[0], node.args[0], weight, False, added[1], (added[0], node)))
            else:
                forms.append(LinearForm(node, node.args[0], weight, False, None, (node,)))
        elif is_call(node, {torch.addmm}, "addmm") and len(node.args) == 3 and not node.kwargs and weight_like(node.args[2]):
            bias, x = node.args[0], node.args[1]
            if isinstance(x, fx.Node) and isinstance(bias, fx.Node) and getattr(node_value(bias), "dim", lambda: 0)() == 1:
                forms.append(LinearForm(node, x, node.args[2], True, bias, (node,)))  # type: ignore[arg-type]
    return forms
