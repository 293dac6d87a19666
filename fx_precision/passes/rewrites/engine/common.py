"""What every engine-contract rewrite shares: op matching, one way to replace a node, and the record of a rewrite.

is_call(node, targets, method)     a call_function of one of ``targets``, or a call_method ``method``
replace_node(graph, old, build)    build the replacement before ``old`` (each node made gets ``old``'s
                                   module stack and trace, and the op class's mark), point ``old``'s
                                   uses at it, erase ``old`` (or the nodes given)
EngineRewrite                      what one rewrite did: op class, the node made, the node it stands for
reaches_output(node)               the value leaves the graph through views, casts and constant scaling (the logits)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from fx_precision.contract.vocabulary import OpClass
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import ENGINE_MADE, is_call, module_path

__all__ = ["ADD", "ENGINE_MADE", "MUL", "EngineRewrite", "RewriteFn", "is_call", "reaches_output", "record", "replace_node"]

ADD = {operator.add, torch.add, operator.iadd}
MUL = {operator.mul, torch.mul}


@dataclass(frozen=True)
class EngineRewrite:
    """One rewrite of an engine-contract op class: the node it made, the node whose value it computes the
    engine's way, where, and what it does."""

    op_class: OpClass
    node: str
    of: str
    module: str
    what: str


def replace_node(
    graph: fx.Graph, old: fx.Node, build: Callable[[], fx.Node], op_class: OpClass, *, erase: Sequence[fx.Node] | None = None
) -> fx.Node:
    """``build()`` (inserting before ``old``) becomes what ``old``'s users read; every node it made carries ``old``'s
    module stack and stack trace, and the op class in ``ENGINE_MADE``; then ``old`` (or ``erase``) is erased."""
    before = set(graph.nodes)
    with graph.inserting_before(old):
        new = build()
    for made in graph.nodes:
        if made not in before:
            made.meta["nn_module_stack"] = dict(old.meta.get("nn_module_stack") or {})
            made.meta["stack_trace"] = old.meta.get("stack_trace")
            made.meta[ENGINE_MADE] = str(op_class)
    if new is not old:
        old.replace_all_uses_with(new)
    for node in erase if erase is not None else (old,):
        graph.erase_node(node)
    return new


def record(op_class: OpClass, made: fx.Node, of: fx.Node, what: str) -> EngineRewrite:
    return EngineRewrite(op_class, made.name, of.name, module_path(of), what)


DIVIDES = (operator.truediv, torch.div, torch.true_divide)
MULTIPLIES = (operator.mul, torch.mul)


def constant_factor(node: fx.Node, by: fx.Node, *, divides: bool = True) -> float | None:
    """The constant ``node`` multiplies ``by`` with (x * c, c * x; with ``divides``, x / c as 1 / c), else None."""
    if node.op != "call_function" or node.kwargs or len(node.args) != 2:
        return None
    first, second = node.args
    if divides and node.target in DIVIDES and first is by and isinstance(second, (int, float)) and not isinstance(second, bool):
        return 1.0 / float(second)
    if node.target in MULTIPLIES:
        other = second if first is by else first if second is by else None
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return float(other)
    return None


PASS_THROUGH = ("to", "float", "view", "reshape", "contiguous", "transpose", "permute", "squeeze", "unsqueeze")


SCALED = (operator.truediv, operator.mul, torch.div, torch.mul, torch.tanh)  # logits scaling (Granite), soft-capping (Gemma 2)


def _scaled(user: fx.Node, by: fx.Node) -> bool:
    """``user`` scales ``by`` by a constant (x / c, x * c, tanh(x)): what a model does to its logits after the lm_head."""
    if user.op != "call_function" or user.target not in SCALED or user.kwargs:
        return False
    others = [a for a in user.args if a is not by]
    return all(isinstance(a, (int, float)) for a in others)


def reaches_output(node: fx.Node) -> bool:
    """The value leaves the graph, through views, slices, casts and scaling by constants only (the logits)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output":
                return True
            viewed = user.op == "call_method" and user.target in PASS_THROUGH
            if viewed or _scaled(user, current) or (user.op == "call_function" and user.target is operator.getitem):
                stack.append(user)
    return False


RewriteFn = Callable[[fx.GraphModule, PassContext], list[EngineRewrite]]  # one op class's rewrite of a graph
