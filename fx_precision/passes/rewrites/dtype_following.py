"""Dtype-following casts: ``y.to(x.dtype)`` is traced by Dynamo as ``y.to(<x's dtype then>)``.

When the pass narrows a value (gather emulation, a source cast), code that *followed* that
value's dtype was specialised to the old, wide dtype at trace time:

    traced with the leak                       after narrowing the embedding
    cos.to(dtype=x.dtype)   -> .to(fp32)       .to(fp32)  <- still fp32: should follow x, now bf16
    h.to(input_dtype)       -> .to(fp32)       .to(fp32)  <- same
    h.to(torch.float32)     -> .to(fp32)       .to(fp32)  <- a literal: the program asked, keep it

A cast that, as traced, was a no-op to a dtype the pass narrowed away (so it followed a wide
value), applied to a value that was wide because of the leak or is a constant table, and whose
source line names no literal float dtype (``torch.float32``, ``.float()``, ...), followed a traced
dtype: it is retargeted to what that dtype became. A tensor factory with a traced ``dtype=`` (no
literal on its line) follows the same way when its value meets a stream value of that dtype. ``x.to(weight.dtype)`` on a narrow ``x`` (a
real upcast as traced) is left alone, and so is one whose value meets, at an op that does not
promote mixed dtypes (a custom op, an in-place op), another input the fix leaves at the old dtype:
that cast followed the weight it meets, not the stream (transformers' MoE experts:
``grouped_mm_fallback(input.to(weight.dtype), weight, offs)``). ``type_as`` needs nothing (it follows at run time). Limitation: a cast
that followed a deliberately wide value through a variable (``a.to(b.dtype)`` with ``b`` an fp32
island) cannot be told apart from one that followed the stream; every retarget is reported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fx_precision.dtypes import dtype_name
from fx_precision.passes.graph.annotate import GraphAnnotation
from fx_precision.passes.graph.cast_literals import LITERAL_DTYPE, names_literal_dtype
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind, NodeKind
from fx_precision.passes.graph.nodes import (
    is_cast,
    is_view,
    module_path,
    node_dtype,
    one_dtype_users,
    promotes_mixed_dtypes,
    source_line,
)


def _cast_target(node: fx.Node) -> tuple[str, int | str, torch.dtype] | None:
    """Where the dtype argument of a ``.to(...)`` / ``.type(...)`` sits, and its value."""
    if node.op != "call_method" or node.target not in ("to", "type"):
        return None
    for i, arg in enumerate(node.args[1:], start=1):
        if isinstance(arg, torch.dtype):
            return ("args", i, arg)
    value = node.kwargs.get("dtype")
    if isinstance(value, torch.dtype):
        return ("kwargs", "dtype", value)
    return None


def _factory_target(node: fx.Node) -> tuple[str, int | str, torch.dtype] | None:
    """A tensor factory (no tensor inputs: ``torch.tensor([], dtype=D)``, ``torch.zeros(..., dtype=D)``)."""
    if node.op != "call_function" or node.all_input_nodes:
        return None
    value = node.kwargs.get("dtype")
    return ("kwargs", "dtype", value) if isinstance(value, torch.dtype) else None


def _meets_stream_value(node: fx.Node, old: torch.dtype, before: GraphAnnotation) -> bool:
    """Whether a factory's value meets, at one of its users, a value at ``old`` that the leak made
    wide: then its dtype followed the stream (transformers' KV cache: ``torch.tensor([], dtype=k.dtype)``)."""
    for user in node.users:
        for other in user.all_input_nodes:
            info = before.info.get(other)
            if other is not node and info is not None and info.dtype == old and info.kind in (NodeKind.PROPAGATION, NodeKind.SOURCE):
                return True
    return False


def _weight_read_dtype(node: fx.Node, reads: dict[str, torch.dtype]) -> torch.dtype | None:
    """The dtype a cast this rewrite inserted gives ``node`` (back through views), or None."""
    while True:
        if node.name in reads:
            return reads[node.name]
        if not (is_view(node) and node.args and isinstance(node.args[0], fx.Node)):
            return None
        node = node.args[0]


def _traced_origin(node: fx.Node, reads: dict[str, torch.dtype]) -> fx.Node:
    """``node`` back through views and the casts this rewrite inserted: a node of the graph as traced."""
    while (is_view(node) or node.name in reads) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _followed_weight(node: fx.Node, old: torch.dtype, reads: dict[str, torch.dtype], before: GraphAnnotation) -> torch.dtype | None:
    """What a cast to ``old`` that met, at an op needing one dtype, a weight read at ``old`` must now
    follow: the dtype this rewrite cast that read to (gather emulation, a weight-read cast)."""
    for user in one_dtype_users(node):
        for other in user.all_input_nodes:
            if other is node:
                continue
            new = _weight_read_dtype(other, reads)
            traced = before.info.get(_traced_origin(other, reads))
            if new is not None and new != old and traced is not None and traced.kind is NodeKind.WEIGHT and traced.dtype == old:
                return new
    return None


def retarget_weight_following(
    gm: fx.GraphModule, reads: dict[str, torch.dtype], before: GraphAnnotation
) -> tuple[list[InsertedCast], set[str]]:
    """``input.to(weight.dtype)`` into an op that needs one dtype (``grouped_mm``), where this rewrite cast
    the weight read (``reads``: inserted cast node -> its dtype): the cast follows the weight to its new
    dtype, literal or real upcast as traced or not, since the op runs only at one dtype. Returns the
    retargets and the names of the casts it retargeted (the stream rule leaves them alone)."""
    changed, names = [], set()
    for node in gm.graph.nodes:
        if node.name in reads or node not in before.info:
            continue
        target = _cast_target(node)
        if target is None:
            continue
        where, key, old = target
        new = _followed_weight(node, old, reads, before)
        if new is None:
            continue
        names.add(node.name)
        traced = (source_line(node) or "").split(": ", 1)[-1].strip()
        why = (f"weight-following cast retargeted {dtype_name(old)} -> {dtype_name(new)}: it meets, at an op that needs one dtype, "
               f"a weight read now at {dtype_name(new)} (traced as {traced!r})")  # fmt: skip
        changed.append(_retargeted(node, where, key, old, new, why, cast=True))
    return changed, names


def _retargeted(node: fx.Node, where: str, key: int | str, old: torch.dtype, new: torch.dtype, why: str, *, cast: bool) -> InsertedCast:
    """Set ``node``'s dtype argument (``where``: args or kwargs, at ``key``) from ``old`` to ``new``, and the record of it
    (``cast``: the node casts its first argument, the subject; else a factory, its own subject)."""
    if where == "args":
        args = list(node.args)
        args[int(key)] = new
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, "dtype": new}
    subject = node.args[0] if cast and node.args and isinstance(node.args[0], fx.Node) else None
    return InsertedCast(
        node.name,
        subject.name if subject is not None else node.name,
        node_dtype(subject) if subject is not None else old,
        new,
        why,
        module_path(node),
        kind=CastKind.RETARGET,
    )


def retarget_dtype_following(
    gm: fx.GraphModule, narrowed: dict[torch.dtype, torch.dtype], inserted: set[str], before: GraphAnnotation
) -> list[InsertedCast]:
    """Retarget the casts that followed a narrowed-away dtype (see the module docstring).

    ``before``: the annotation of the graph as traced, before the pass inserted anything. A cast
    qualifies when, as traced, it was a no-op to a narrowed-away dtype (so it followed a wide value)
    of a value that was wide because of the leak (a propagation) or a constant table (a weight),
    not an intentional fp32 island, and its source line names no literal float dtype.
    """
    changed = []
    for node in gm.graph.nodes:
        if node.name in inserted or node not in before.info:
            continue
        target = _cast_target(node)
        factory = target is None
        if factory:
            target = _factory_target(node)
        if target is None or target[2] not in narrowed:
            continue
        if factory:
            if not _meets_stream_value(node, target[2], before):
                continue
        else:
            source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            traced = before.info.get(source) if source is not None else None
            if traced is None or traced.dtype != target[2] or traced.kind not in _FOLLOWABLE:
                continue
        code = (source_line(node) or "").split(": ", 1)[-1]
        literal = bool(LITERAL_DTYPE.search(code)) if factory else names_literal_dtype(node)
        if not code or literal or (not factory and _meets_unnarrowed_input(node, target[2], before)):
            continue
        where, key, old = target
        new = narrowed[old]
        what = "factory" if factory else "cast"
        why = f"dtype-following {what} retargeted {dtype_name(old)} -> {dtype_name(new)} (traced as {code.strip()!r})"
        changed.append(_retargeted(node, where, key, old, new, why, cast=not factory))
    changed += _retarget_stream_constants(gm, narrowed, inserted, before)
    if changed:
        gm.recompile()
    return changed


def _retarget_stream_constants(
    gm: fx.GraphModule, narrowed: dict[torch.dtype, torch.dtype], inserted: set[str], before: GraphAnnotation
) -> list[InsertedCast]:
    """Constants built at the stream's traced dtype: an attention mask ``where(causal, zeros((),
    dtype=D), finfo(D).min)`` with ``D = inputs_embeds.dtype``. A constant (factories only, no
    weights) at a narrowed-away dtype that crosses a module boundary and there meets only
    compute-dtype activations, in ops that promote, followed the stream when traced: its factories
    are retargeted and the ``finfo(old).min / max`` baked into it become ``finfo(new)``'s, which is
    what the program computes once the leak is fixed (and not ``-inf``, as a cast would make)."""
    changed: list[InsertedCast] = []
    done: set[fx.Node] = set()
    for node, info in list(before.info.items()):
        if info.kind is not NodeKind.CONSTANT or info.dtype not in narrowed or node in done or node.name in inserted:
            continue
        elsewhere = [u for u in node.users if module_path(u) != info.module]
        if not elsewhere or not all(_meets_compute_in_promotion(u, node, before) for u in elsewhere):
            continue
        old, new = info.dtype, narrowed[info.dtype]
        for member in _constant_subgraph(node, before):
            done.add(member)
            target = _factory_target(member)
            if target is not None and target[2] == old and not LITERAL_DTYPE.search((source_line(member) or "").split(": ", 1)[-1]):
                member.kwargs = {**member.kwargs, "dtype": new}
            member.args = tuple(_finfo_swap(a, old, new) for a in member.args)
        changed.append(
            InsertedCast(
                node.name,
                node.name,
                old,
                new,
                f"dtype-following constant retargeted {dtype_name(old)} -> {dtype_name(new)}: built at the stream's traced dtype "
                f"and mixed into {', '.join(sorted({module_path(u) or '<root>' for u in elsewhere}))}",
                module_path(node),
                kind=CastKind.RETARGET,
            )
        )
    return changed


def _meets_compute_in_promotion(user: fx.Node, constant: fx.Node, before: GraphAnnotation) -> bool:
    if is_cast(user) or not promotes_mixed_dtypes(user):
        return False
    others = [before.info.get(o) for o in user.all_input_nodes if o is not constant]
    known = [o for o in others if o is not None]
    return (
        bool(others)
        and len(known) == len(others)
        and all(o.kind is NodeKind.COMPUTE for o in known if o.dtype is not None and o.dtype.is_floating_point)
    )


def _constant_subgraph(node: fx.Node, before: GraphAnnotation) -> list[fx.Node]:
    """``node`` and the constant nodes it is built from."""
    out, stack, seen = [], [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        info = before.info.get(current)
        if info is None or info.kind is not NodeKind.CONSTANT or current.op != "call_function":
            continue
        out.append(current)
        stack.extend(current.all_input_nodes)
    return out


def _finfo_swap(arg: Any, old: torch.dtype, new: torch.dtype) -> Any:
    """``torch.finfo(old).min / max`` baked into a graph argument -> ``finfo(new)``'s."""
    if isinstance(arg, float):
        for which in ("min", "max"):
            if arg == getattr(torch.finfo(old), which):
                return float(getattr(torch.finfo(new), which))
    return arg


# what a dtype-following cast may have been applied to: the leaking stream, or a static table (RoPE cos)
_FOLLOWABLE = (NodeKind.PROPAGATION, NodeKind.SOURCE, NodeKind.WEIGHT, NodeKind.CONSTANT)
# kinds whose dtype the fix does not narrow (a source only where it leaks)
_STAYS = (NodeKind.WEIGHT, NodeKind.CONSTANT, NodeKind.INTENTIONAL, NodeKind.SOURCE)


def _meets_unnarrowed_input(node: fx.Node, old: torch.dtype, before: GraphAnnotation) -> bool:
    """Whether ``node``'s value (through views) meets, at an op that does not promote, another float
    input that stays at ``old``: then the cast followed that input's dtype, not the stream's."""
    for user in one_dtype_users(node):
        for other in user.all_input_nodes:
            info = before.info.get(other)
            if other is not node and info is not None and info.dtype == old and info.kind in _STAYS:
                return True
    return False


def narrowed_map(casts: list[InsertedCast], compute: torch.dtype | None) -> dict[torch.dtype, torch.dtype]:
    """``{wide dtype: what it became}`` over the casts that narrowed something (compute wins ties)."""
    out: dict[torch.dtype, torch.dtype] = {}
    for cast in casts:
        wide, new = cast.frm, cast.to
        if wide is not None and wide.itemsize > new.itemsize and (wide not in out or new == compute):
            out[wide] = new
    return out
