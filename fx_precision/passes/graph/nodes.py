"""Reading a Dynamo FX graph: a node's value and dtype, its module, its source line, its parameter.

Dynamo records per node ``meta["example_value"]`` (a FakeTensor, or a tuple of them),
``meta["nn_module_stack"]`` (outermost .. innermost module, as source strings such as
``L['self'].model.layers.0``) and ``meta["stack_trace"]``. Parameters and buffers are lifted
to placeholders named after their source (``l_self_modules_model_modules_embed_tokens_parameters_weight_``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple, TypeGuard

import torch
from torch import fx

from fx_precision.passes.graph.kinds import ParamKind

VIEW_METHODS = frozenset(
    {"view", "reshape", "t", "transpose", "permute", "expand", "contiguous", "unsqueeze", "squeeze", "flatten", "view_as", "expand_as"}
)
CAST_METHODS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as"})
VIEW_FUNCTIONS = frozenset({torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, torch.flatten, torch.t})


def node_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    return []


def node_dtype(node: fx.Node) -> torch.dtype | None:
    """The node's dtype; for a tuple of tensors the widest floating one (else the first)."""
    tensors = tensors_in(node_value(node))
    if not tensors:
        return None
    floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
    if floats:
        return max(floats, key=lambda d: d.itemsize)
    return tensors[0].dtype


_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\](\[\d+\])?")


def normalise_source(text: str) -> str:
    """``L['self']._modules['model'].layers[0]`` -> ``model.layers.0``."""
    text = _ROOT.sub("", text)
    text = re.sub(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r".\1", text)
    text = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", text)
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    return text.lstrip(".")


def module_path(node: fx.Node) -> str:
    """FQN of the innermost module of the model the node was traced in ("" for the traced root).

    Only modules Dynamo reached from the traced call's arguments (``L[...]``) are the model's. A module it reached
    through a global is a function dressed as a module, no part of the model's tree: transformers >= 5.25 with the
    ``kernels`` package calls ``torch_chunk_gated_delta_rule`` and ``causal_conv1d_forward`` as
    ``G['...modeling_qwen3_5'].torch_chunk_gated_delta_rule``, an ``nn.Module`` held in no parent. Its ops belong
    to the model's module that called it, as a plain function's do."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        if _ROOT.match(str(path)):
            return normalise_source(str(path))
    return ""


class StackFrame(NamedTuple):
    """The innermost user frame of a node's Dynamo stack trace."""

    file: str
    line: int
    function: str
    code: str


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


_OWN_MODES = (os.path.join("fx_precision", "routes.py"),)  # fx_precision's torch-function modes: their frames are not the program's


def stack_frame(node: fx.Node) -> StackFrame | None:
    """The innermost frame of ``meta["stack_trace"]`` (the line of user code that made the node), or None; a frame of
    fx_precision's own torch-function mode (routes.RouteTap, entered around a forward) is skipped: every op traced
    under it passes through it, and the line that made the op is the program's one before."""
    return _innermost_frame(node.meta.get("stack_trace") or "")


@functools.lru_cache(maxsize=65536)
def _innermost_frame(trace: str) -> StackFrame | None:
    """Parsed once per distinct trace (a str hashes once): the analysis asks for every cast node's frame per cast."""
    frames = [f for f in _FRAME.findall(trace) if not f[0].endswith(_OWN_MODES)]
    if not frames:
        return None
    file, line, function, code = frames[-1]
    return StackFrame(file, int(line), function, code.strip())


def source_line(node: fx.Node) -> str | None:
    """``file:line in function: code`` of the innermost user frame in the node's stack trace."""
    frame = stack_frame(node)
    return None if frame is None else f"{frame.file}:{frame.line} in {frame.function}: {frame.code}"


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return {"add": "+", "mul": "*", "sub": "-", "truediv": "/", "iadd": "+=", "imul": "*="}.get(name, name)
    if node.op == "call_module":
        return f"module {node.target}"
    return node.op


_PARAM_MARK = re.compile(r"_(parameters|buffers)_")


def placeholder_attr(node: fx.Node) -> tuple[ParamKind, str] | None:
    """(``parameter`` | ``buffer``, lower-cased FQN key) of a lifted parameter/buffer placeholder."""
    match = _PARAM_MARK.search(node.name)
    if node.op != "placeholder" or match is None:
        return None
    kind = ParamKind.PARAMETER if match.group(1) == "parameters" else ParamKind.BUFFER
    body = node.name.removeprefix("l_").rstrip("_")
    body = re.sub(r"^(self|args_\d+|fn|mod|model|kwargs_\w+?)_(?=modules_|parameters_|buffers_)", "", body)
    body = re.sub(r"(?:^|_)(modules|parameters|buffers)_", ".", body).lstrip(".")
    return kind, body.lower()


def is_cast(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in CAST_METHODS


def is_view(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in VIEW_METHODS) or (node.op == "call_function" and node.target in VIEW_FUNCTIONS)


def redirect_through_cast(node: fx.Node, dtype: torch.dtype, *, before: fx.Node | None = None) -> fx.Node:
    """Insert ``node.to(dtype)`` (right after ``node``, or before ``before``) and route every other
    use of ``node`` through it; the cast inherits ``node``'s module stack and stack trace."""
    graph = node.graph
    with graph.inserting_before(before) if before is not None else graph.inserting_after(node):
        cast = graph.call_method("to", (node, dtype))
    cast.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
    cast.meta["stack_trace"] = node.meta.get("stack_trace")
    node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    return cast


def cast_for_one_use(node: fx.Node, user: fx.Node, dtype: torch.dtype) -> fx.Node:
    """Insert ``node.to(dtype)`` right after ``node`` and route only ``user``'s use through it."""
    with node.graph.inserting_after(node):
        cast = node.graph.call_method("to", (node, dtype))
    cast.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
    cast.meta["stack_trace"] = node.meta.get("stack_trace")
    user.replace_input_with(node, cast)
    return cast


def is_custom_op(node: fx.Node) -> bool:
    """A call of a ``torch.ops`` operator outside aten / prims: unknown to autocast and to type promotion."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in ("aten", "prims")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] not in ("aten", "prims")
    return False


# ops that need their float inputs at one dtype and that autocast does not cover (grouped GEMMs)
ONE_DTYPE_FUNCTIONS: frozenset[Any] = frozenset(
    f for f in (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None)) if f is not None
)


def promotes_mixed_dtypes(node: fx.Node) -> bool:
    """False for ops that need their float inputs at one dtype: custom ops, in-place methods
    (``index_add_``) and grouped GEMMs (``torch._grouped_mm``)."""
    if node.op == "call_method":
        return not str(node.target).endswith("_")
    return not is_custom_op(node) and node.target not in ONE_DTYPE_FUNCTIONS


def one_dtype_users(node: fx.Node) -> Iterator[fx.Node]:
    """The ops that take ``node``'s value (through views) and need their float inputs at one dtype
    (``promotes_mixed_dtypes`` is False): where a cast of ``node`` must meet its peers' dtype."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view(user):
            stack.extend(user.users)
        elif not promotes_mixed_dtypes(user):
            yield user


def behind_views(node: fx.Node) -> fx.Node:
    """``node`` back through views (``weight.transpose(-2, -1)`` -> ``weight``)."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


ENGINE_MADE = "fxp_engine_made"  # node meta: the op class of the engine-contract rewrite that wrote the node


def is_call(node: object, targets: Collection[Any] | Callable[..., Any], method: str | None = None) -> TypeGuard[fx.Node]:
    """A call_function of one of ``targets``, or a call_method named ``method``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return method is not None and node.target == method
    wanted = targets if isinstance(targets, (set, frozenset, list, tuple)) else {targets}
    return node.op == "call_function" and node.target in wanted
