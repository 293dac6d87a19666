"""The op-level drill-down: the first origin run again alone on its recorded inputs (or on the engine's), on both
sides, under a TorchDispatchMode; the first aten op whose output differs, aligned by op sequence (autocast's
inserted casts ignored), with the autocast rule that explains it."""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fx_precision.compare.bands import relative_difference
from fx_precision.compare.report import CallDiff, OpDiff
from fx_precision.dtypes import dtype_name, parse_dtype
from fx_precision.dump import Dump
from fx_precision.module_graph import module_label

_IGNORED = re.compile(r"^aten\.(_to_copy|to|detach|alias|lift_fresh|_local_scalar_dense)\b")


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t.detach().clone() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        packet = getattr(func, "overloadpacket", None)
        self.ops.append((packet._qualified_op_name.replace("::", ".") if packet is not None else str(func), tensors))
        return out


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _run_alone(dump: Dump, key: tuple[str, int]) -> list[tuple[str, list[torch.Tensor]]]:
    """The module of ``key`` run again alone on its recorded arguments, under the dump's autocast state."""
    module, args, kwargs = dump.replays[key]
    ctx = torch.autocast(dump.device_type, dtype=parse_dtype(dump.autocast)) if dump.autocast else contextlib.nullcontext()
    args, kwargs = tree_map(_clone, args), tree_map(_clone, kwargs)  # outside the mode: not one of the module's ops
    recorder = _OpRecorder()
    with torch.no_grad(), ctx, recorder:
        module(*args, **kwargs)
    return recorder.ops


def first_differing_op(origin: CallDiff, da: Dump, db: Dump) -> OpDiff | None:
    key = (origin.fqn, origin.call)
    if key in da.replays and key not in db.replays and db.engine:
        return _drill_down_on_engine_inputs(origin, da, db)
    if key not in da.replays or key not in db.replays:
        return None
    ops_a, ops_b = _run_alone(da, key), _run_alone(db, key)
    auto_a, auto_b = da.autocast is not None, db.autocast is not None
    kept_a = [op for op in ops_a if not _IGNORED.match(op[0])]
    kept_b = [op for op in ops_b if not _IGNORED.match(op[0])]
    matcher = difflib.SequenceMatcher(a=[op[0] for op in kept_a], b=[op[0] for op in kept_b], autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            (name_a, outs_a), (name_b, outs_b) = kept_a[block.a + k], kept_b[block.b + k]
            for x, y in zip(outs_a, outs_b, strict=False):
                if x.shape != y.shape:
                    continue
                low = x.dtype if x.dtype.itemsize <= y.dtype.itemsize else y.dtype
                if torch.equal(x.to(low), y.to(low)):
                    continue
                rel = relative_difference(x.double(), y.double())
                explanation = _explain(name_a, x.dtype, y.dtype, auto_a, auto_b)
                dtypes = dtype_name(x.dtype), dtype_name(y.dtype)
                return OpDiff(module_label(origin.fqn), block.a + k, name_a, name_b, *dtypes, rel, explanation)
    return _one_sided_cast(origin, ops_a, ops_b)


def _with_inputs_of(dump: Dump, key: tuple[str, int], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], int]:
    """``args`` / ``kwargs`` with each tensor the other dump recorded for this call put in its place."""
    recorded = {r.path: r.tensor for r in dump.records if (r.fqn, r.call) == key and r.io == "in" and r.tensor is not None}
    used = 0

    def swap(path: str, value: Any) -> Any:
        nonlocal used
        if isinstance(value, torch.Tensor) and path in recorded and recorded[path].shape == value.shape:
            used += 1
            return recorded[path].to(value.dtype) if value.is_floating_point() else recorded[path]
        return value

    new_args = tuple(swap(f"args[{i}]", a) for i, a in enumerate(args))
    new_kwargs = {k: swap(f"kwargs.{k}", v) for k, v in kwargs.items()}
    return new_args, new_kwargs, used


def _drill_down_on_engine_inputs(origin: CallDiff, da: Dump, db: Dump) -> OpDiff | None:
    """Side b is an engine (no module to run again): run side a's origin alone on the inputs the engine
    recorded for it. When the output it makes still differs from the engine's, the module's own
    arithmetic parts from the engine's; named is the op that made that output."""
    key = (origin.fqn, origin.call)
    module, args, kwargs = da.replays[key]
    args, kwargs, used = _with_inputs_of(db, key, args, kwargs)
    want = next((r.tensor for r in db.records if (r.fqn, r.call) == key and r.io == "out" and r.tensor is not None), None)
    if not used or want is None:
        return None
    ctx = torch.autocast(da.device_type, dtype=parse_dtype(da.autocast)) if da.autocast else contextlib.nullcontext()
    recorder = _OpRecorder()
    with torch.no_grad(), ctx, recorder:
        module(*args, **kwargs)
    target = want.reshape(-1)
    for index in range(len(recorder.ops) - 1, -1, -1):  # the op that made the output: the last of its size
        name, outs = recorder.ops[index]
        made = next((x for x in outs if x.numel() == target.numel()), None)
        if made is None or _IGNORED.match(name):
            continue
        if torch.equal(made.reshape(-1).double(), target.double()):
            return None  # on the engine's inputs the module computes the engine's output: the inputs were the difference
        return OpDiff(
            module_label(origin.fqn),
            index,
            name,
            f"{(db.engine or {}).get('name', 'engine')} (recorded output)",
            dtype_name(made.dtype),
            dtype_name(want.dtype),
            relative_difference(made.double().reshape(-1), target.double()),
            f"run alone on the engine's inputs of this call, the module's output (made by `{name.removeprefix('aten.')}`) still "
            "differs from the engine's: the module's own arithmetic parts from the engine's, not its inputs",
        )
    return None


def _one_sided_cast(origin: CallDiff, ops_a: list[Any], ops_b: list[Any]) -> OpDiff | None:
    """No aligned op differs: the difference is a cast that runs on one side only (``cos.to(x.dtype)``
    is a no-op where ``x`` is fp32 and a rounding where it is bf16)."""
    casts_a = [(name, outs) for name, outs in ops_a if _IGNORED.match(name) and outs]
    casts_b = [(name, outs) for name, outs in ops_b if _IGNORED.match(name) and outs]
    dtypes_a = [dtype_name(o[0].dtype) for _, o in casts_a]
    dtypes_b = [dtype_name(o[0].dtype) for _, o in casts_b]
    if dtypes_a == dtypes_b:
        return None
    return OpDiff(
        module_label(origin.fqn),
        -1,
        casts_a[0][0] if casts_a else "-",
        casts_b[0][0] if casts_b else "-",
        ",".join(dtypes_a) or "-",
        ",".join(dtypes_b) or "-",
        float("nan"),
        f"the ops agree; the casts do not: side a casts to [{', '.join(dtypes_a)}], side b to [{', '.join(dtypes_b)}] "
        "(a cast that follows another tensor's dtype rounds on one side only)",
    )


def _explain(op: str, dtype_a: torch.dtype, dtype_b: torch.dtype, autocast_a: bool, autocast_b: bool) -> str:
    short = op.removeprefix("aten.")
    if dtype_a != dtype_b:
        if autocast_a and not autocast_b:
            return f"autocast runs `{short}` in {dtype_name(dtype_a)} on side a; side b runs it in {dtype_name(dtype_b)}"
        if autocast_b and not autocast_a:
            return f"autocast runs `{short}` in {dtype_name(dtype_b)} on side b; side a runs it in {dtype_name(dtype_a)}"
        return f"side a runs `{short}` in {dtype_name(dtype_a)}, side b in {dtype_name(dtype_b)}"
    return f"`{short}` runs in {dtype_name(dtype_a)} on both sides; its inputs already differ by rounding inside the module"
