"""Dtype annotation of a Dynamo graph: what each node is, where a wide dtype came from, what crosses a module.

Under bf16 compute, tiny Qwen3.5 with its embedding gathered at fp32 annotates as::

    embed_tokens.weight   placeholder  fp32  weight
    embedding             model.embed_tokens          fp32  SOURCE (uncovered-op)       origin {embedding}
    float                 model.layers.0.input_layernorm  fp32  propagation             origin {embedding}
    ...                   (the norm's type_as(x) keeps fp32: x is fp32)
    linear                model.layers.0...q_proj     bf16  compute   (autocast covers linear)
    add                   model.layers.0              fp32  propagation (residual)      origin {embedding}

Kinds (``NodeKind``, of float tensor nodes):

    weight        a parameter or buffer, or computed from them (and constants) alone (w.float(), 1 + w)
    constant      a factory (arange, zeros, tensor), a lifted Python number, or computed from those alone
    input         a graph input that is not a parameter (wide: it arrived wide)
    compute       not wider than the compute dtype
    intentional   wide because the program asked: an explicit cast of a narrow value (x.float()),
                  an op autocast runs in fp32 (softmax, norms), a constant created wide
    source        wide without the program asking: an op autocast does not cover consuming a wide
                  weight (``uncovered-op``), or an elementwise op mixing a wide weight with a
                  compute-dtype activation (``weight-promotion``). A cast of a narrow activation
                  to a weight's dtype (``input.to(weight.dtype)``, no literal dtype) into an op that
                  needs one dtype and autocast does not cover (``grouped_mm``: MoE experts) is
                  that op's ``uncovered-op`` source: the program asked for the weight's dtype,
                  which is the gather policy's, not for fp32
    propagation   wide because an activation input is wide (type_as, residual adds, ...)

A *stream* tensor is an activation that crosses a module boundary (its producer and a consumer
sit in different modules) or leaves the graph. Saved-for-backward tensors are not visible at
this level: AOTAutograd decides them later.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from fx_precision.dtypes import is_analysed_float
from fx_precision.module_graph import module_label
from fx_precision.passes.graph.cast_literals import names_literal_dtype
from fx_precision.passes.graph.kinds import FindingKind, NodeKind, ParamKind
from fx_precision.passes.graph.nodes import (
    behind_views,
    is_cast,
    is_custom_op,
    is_view,
    module_path,
    node_dtype,
    node_value,
    normalise_source,
    one_dtype_users,
    op_name,
    placeholder_attr,
    source_line,
)
from fx_precision.passes.graph.units import UnitIndex


@dataclass
class NodeInfo:
    node: fx.Node
    dtype: torch.dtype | None
    module: str
    kind: NodeKind
    source_kind: FindingKind | None = None  # UNCOVERED | PROMOTION (kind is SOURCE)
    param: str | None = None  # FQN of the parameter / buffer behind a placeholder
    param_kind: ParamKind | None = None
    origin: frozenset[str] = frozenset()  # names of the source/intentional/input nodes behind a wide value
    wide_parent: fx.Node | None = None
    wide: bool = False
    stream: bool = False
    unit: str | None = None
    consumers: tuple[fx.Node, ...] = ()  # the node's users when annotated (a later pass may insert casts between)
    uncovered_op: fx.Node | None = None  # a weight-following cast's source: the op that reads the weight (wide_parent)

    @property
    def name(self) -> str:
        return self.node.name

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype else "-"
        return f"{module_label(self.module)}: {op_name(self.node)} -> {dtype} [{self.node.name}]"

    @property
    def line(self) -> str | None:
        return source_line(self.node)


@dataclass
class GraphAnnotation:
    gm: fx.GraphModule
    compute: torch.dtype | None
    info: dict[fx.Node, NodeInfo] = field(default_factory=dict)
    _names: dict[str, NodeInfo] = field(default_factory=dict, repr=False)

    def get(self, name: str) -> NodeInfo | None:
        """The node named ``name``, by a dict built once per annotation (kept in step by ``forget``)."""
        if len(self._names) != len(self.info):
            self._names = {node.name: info for node, info in self.info.items()}
        return self._names.get(name)

    def by_name(self, name: str) -> NodeInfo:
        info = self.get(name)
        if info is None:
            raise KeyError(name)
        return info

    def forget(self, node: fx.Node) -> None:
        """Drop a node a pass erased from the graph."""
        self.info.pop(node, None)
        self._names.pop(node.name, None)

    def chain(self, start: NodeInfo, stop: str | None = None) -> list[NodeInfo]:
        """``start`` back to its source along wide parents (one entry per module run, and the source)."""
        path = [start]
        seen = {start.node}
        while path[-1].wide_parent is not None and path[-1].wide_parent not in seen and (stop is None or path[-1].name != stop):
            parent = path[-1].wide_parent
            seen.add(parent)
            path.append(self.info[parent])
        compressed: list[NodeInfo] = []
        for i, item in enumerate(path):
            last = i == len(path) - 1
            if last or not compressed or item.module != compressed[-1].module:
                compressed.append(item)
        return compressed


def is_wide(dtype: torch.dtype | None, compute: torch.dtype | None) -> bool:
    return compute is not None and dtype is not None and is_analysed_float(dtype) and dtype.itemsize > compute.itemsize


def param_names(
    gm: fx.GraphModule, example_inputs: list[object] | None, known: dict[int, tuple[str, ParamKind]] | None
) -> dict[fx.Node, tuple[str, ParamKind]]:
    """Placeholder -> (FQN, ParamKind): by object identity where known, else by name.

    ``known``: ``id(tensor) -> (fqn, kind)`` for the model's parameters and buffers (lint has the
    model); the backend has only the graph, so it falls back to Dynamo's placeholder names and,
    for letter case, to ``gm._param_name_to_source``.
    """
    case: dict[str, str] = {}
    for source in getattr(gm, "_param_name_to_source", {}).values():
        name = getattr(source, "name", None)
        text = name() if callable(name) else name
        if isinstance(text, str):
            fqn = normalise_source(text)
            case[fqn.lower()] = fqn
    out: dict[fx.Node, tuple[str, ParamKind]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if known and example_inputs is not None and i < len(example_inputs) and id(example_inputs[i]) in known:
            out[node] = known[id(example_inputs[i])]
            continue
        attr = placeholder_attr(node)
        if attr is not None:
            kind, key = attr
            out[node] = (case.get(key, key), kind)
    return out


def annotate(
    gm: fx.GraphModule,
    compute: torch.dtype | None,
    units: UnitIndex,
    params: dict[fx.Node, tuple[str, ParamKind]],
) -> GraphAnnotation:
    """Classify every node (see the module docstring); ``compute=None`` means no autocast."""
    ann = GraphAnnotation(gm, compute)
    for node in gm.graph.nodes:
        dtype = node_dtype(node)
        module = module_path(node)
        info = NodeInfo(node, dtype, module, NodeKind.OTHER, consumers=tuple(node.users))
        ann.info[node] = info
        if node.op == "output":
            continue
        if node.op == "placeholder":
            if node in params:
                info.param, info.param_kind = params[node]
                info.kind = NodeKind.WEIGHT
                info.unit = units.unit_of_param(info.param)
            elif isinstance(node_value(node), torch.Tensor) and node_value(node).dim() == 0:
                info.kind = NodeKind.CONSTANT  # a Python number Dynamo lifted (dynamic=True)
                info.unit = units.unit_of_module(module)
            else:
                info.kind = NodeKind.INPUT
                info.unit = units.unit_of_module(module)
                if is_wide(dtype, compute):
                    info.wide = True
                    info.origin = frozenset({node.name})
            continue
        info.unit = units.unit_of_module(module)
        tensor_inputs = [n for n in node.all_input_nodes if node_dtype(n) is not None]
        static = [ann.info[n].kind for n in tensor_inputs if ann.info[n].kind.is_static]
        if node.op == "get_attr" or (tensor_inputs and len(static) == len(tensor_inputs)):
            info.kind = NodeKind.WEIGHT if node.op == "get_attr" or NodeKind.WEIGHT in static else NodeKind.CONSTANT
            continue
        if not tensor_inputs and dtype is not None and node.op == "call_function":
            info.kind = NodeKind.CONSTANT  # a factory (arange, ones, zeros)
            continue
        if dtype is None or not dtype.is_floating_point:
            continue  # OTHER
        if not is_wide(dtype, compute):
            info.kind = NodeKind.COMPUTE
            continue
        info.wide = True
        wide_acts = [n for n in tensor_inputs if not ann.info[n].kind.is_static and ann.info[n].wide]
        if wide_acts:
            info.kind = NodeKind.PROPAGATION
            info.wide_parent = wide_acts[0]
            info.origin = frozenset().union(*(ann.info[n].origin for n in wide_acts))
            continue
        wide_static = [n for n in tensor_inputs if ann.info[n].kind.is_static and is_wide(node_dtype(n), compute)]
        read = weight_following_read(node, params) if is_cast(node) else None
        if read is not None:  # input.to(weight.dtype) into grouped_mm: the op's source, reading the weight
            info.kind, info.source_kind = NodeKind.SOURCE, FindingKind.UNCOVERED
            info.uncovered_op, info.wide_parent = read
            info.origin = frozenset({node.name})
            continue
        if is_cast(node) or not wide_static:
            info.kind = NodeKind.INTENTIONAL  # x.float() on a narrow x, softmax in fp32, ...
            info.origin = frozenset({node.name})
            continue
        info.kind = NodeKind.SOURCE
        narrow_float_acts = [
            n for n in tensor_inputs if not ann.info[n].kind.is_static and (node_dtype(n) or torch.int64).is_floating_point
        ]
        info.source_kind = FindingKind.PROMOTION if narrow_float_acts else FindingKind.UNCOVERED
        info.wide_parent = wide_static[0]
        info.origin = frozenset({node.name})

    # stream: activations that cross a module boundary or leave the graph
    for node, info in ann.info.items():
        if node.op == "output" or info.kind.is_static or info.dtype is None or not info.dtype.is_floating_point:
            continue
        if info.kind is NodeKind.INPUT:
            info.stream = True  # it crossed into the compiled region from the caller's module
            continue
        for user in node.users:
            if user.op == "output" or module_path(user) != info.module:
                info.stream = True
                break
    return ann


def weight_following_read(cast: fx.Node, params: dict[fx.Node, tuple[str, ParamKind]]) -> tuple[fx.Node, fx.Node] | None:
    """(op, parameter placeholder) when ``cast`` (no literal dtype on its line) gives its value, through
    views, to an op that needs one dtype and autocast does not cover, which also reads a parameter
    (through views) at the cast's dtype: ``grouped_mm(input.to(weight.dtype), weight)``. None otherwise."""
    dtype = node_dtype(cast)
    if dtype is None or not cast.args or not isinstance(cast.args[0], fx.Node) or node_dtype(cast.args[0]) == dtype:
        return None
    if names_literal_dtype(cast):
        return None
    for user in one_dtype_users(cast):
        if user.op != "call_function" or node_dtype(user) != dtype:
            continue
        for other in user.all_input_nodes:
            param = behind_views(other)
            if other is not cast and node_dtype(other) == dtype and params.get(param, ("", None))[1] is ParamKind.PARAMETER:
                return user, param
    return None


def autocast_covered_uses(ann: GraphAnnotation, node: fx.Node) -> list[fx.Node] | None:
    """The uses of ``node`` (through views and slices) if every one is an op autocast ran at the
    compute dtype (its output is at compute; not a cast, a custom op or a graph output): those
    ops cast ``node`` to compute anyway. ``[]``: no use; None: some use is not covered."""
    uses: list[fx.Node] = []
    stack = list(node.users)
    while stack:
        user = stack.pop()
        sliced = user.target is operator.getitem and isinstance(node_value(user), torch.Tensor)
        if is_view(user) or sliced:
            stack.extend(user.users)
            continue
        info = ann.info.get(user)
        if user.op == "output" or is_cast(user) or is_custom_op(user) or info is None or info.dtype != ann.compute:
            return None
        uses.append(user)
    return uses
