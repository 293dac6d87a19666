"""Did the program write this cast's dtype literally, or follow another tensor's dtype?

Dynamo bakes ``y.to(x.dtype)`` into ``y.to(torch.float32)``: the graph cannot tell a followed dtype
from a literal one, but the program's source can. Several casts often share one line::

    F.layer_norm(h.to(dtype=torch.float32), shape, None, None, eps).to(orig_dtype)
                 └─ cast 1: literal fp32                            └─ cast 2: follows orig_dtype

So each cast node is matched to its own call: the cast calls of the statement at the node's
line, in evaluation order (an inner call before the call that contains it), pair with the graph's
cast nodes traced at that line, in graph order (a line run by several modules repeats the
pattern). When the source is unavailable or the counts disagree (Dynamo folded a cast away), the
whole line decides, as a literal anywhere on it.
"""

from __future__ import annotations

import ast
import functools
import linecache
import re
from collections.abc import Iterator

from torch import fx

from fx_precision.passes.graph.nodes import CAST_METHODS, ENGINE_MADE, is_cast, stack_frame

LITERAL_DTYPE = re.compile(r"torch\.(float32|float64|float16|bfloat16|float|double|half)\b|\.(float|double|half|bfloat16)\(\)")
_FIXED_DTYPE_METHODS = frozenset({"float", "double", "half", "bfloat16"})


def _frame(node: fx.Node) -> tuple[str, int, str] | None:
    frame = stack_frame(node)
    return None if frame is None else (frame.file, frame.line, frame.code)


@functools.lru_cache(maxsize=256)
def _module_ast(file: str) -> ast.Module | None:
    text = "".join(linecache.getlines(file))
    if not text:
        return None
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _evaluation_order(node: ast.AST) -> Iterator[ast.AST]:
    """Post-order: what a call evaluates (its receiver, its arguments) comes before the call."""
    for child in ast.iter_child_nodes(node):
        yield from _evaluation_order(child)
    yield node


@functools.lru_cache(maxsize=4096)
def _cast_calls_at(file: str, line: int) -> tuple[ast.Call, ...]:
    """The cast calls of the innermost statement at ``line`` of ``file``, in evaluation order (cached: a model runs
    one line in every layer, and walking a modeling file's tree per cast node dominated the analysis of a 32-layer model)."""
    tree = _module_ast(file)
    if tree is None:
        return ()
    statements = [s for s in ast.walk(tree) if isinstance(s, ast.stmt) and s.lineno <= line <= (s.end_lineno or s.lineno)]
    if not statements:
        return ()
    innermost = min(statements, key=lambda s: (s.end_lineno or s.lineno) - s.lineno)
    return tuple(
        call
        for call in _evaluation_order(innermost)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in CAST_METHODS and call.lineno == line
    )


def _names_a_dtype(call: ast.Call) -> bool:
    if isinstance(call.func, ast.Attribute) and call.func.attr in _FIXED_DTYPE_METHODS:
        return True
    return any(LITERAL_DTYPE.search(ast.unparse(arg)) for arg in [*call.args, *(k.value for k in call.keywords)])


def names_literal_dtype(node: fx.Node) -> bool:
    """Whether the program wrote this cast's target dtype literally (``torch.float32``, ``.float()``).

    A node without a traced source line counts as literal: the pass then leaves it alone; so does a cast an engine-contract
    rewrite wrote (its dtype is the engine's, literal in the rewrite, though the node keeps the model's source line).
    """
    if node.meta.get(ENGINE_MADE):
        return True
    frame = _frame(node)
    if frame is None:
        return True
    file, line, code = frame
    calls = _cast_calls_at(file, line)
    if calls:
        peers = [n for n in node.graph.nodes if is_cast(n) and _frame(n) == frame]
        if len(peers) % len(calls) == 0:  # each execution of the line traces its casts in order
            return _names_a_dtype(calls[peers.index(node) % len(calls)])
    return bool(LITERAL_DTYPE.search(code))
