"""The train-vs-rollout comparator: where two forwards of one model part, module by module and op by op.

    compare(a, b)                    a, b: dump directories, Dumps, or in-process Sides
    ├── align calls by (FQN, call)   b's FQNs renamed by fqn_map ("self_attn=attn", globs); one-sided calls listed
    ├── per tensor pair              dtypes, shapes, rel diff 1 - 2<x,y>/(|x|^2+|y|^2) in fp64, max / mean |x-y|,
    │                                the same at the narrower dtype when dtypes differ, bitwise, band
    ├── origins                      calls whose inputs match bitwise and whose output does not, and no call inside them
    │                                does the same: a call whose inputs already differ *inherits* the divergence
    ├── first_op                     the first origin run again alone on its recorded inputs, on both sides,
    │                                under a TorchDispatchMode: the first aten op whose output differs, aligned
    │                                by op sequence (autocast's inserted _to_copy casts ignored; they appear on
    │                                one side only), with the autocast rule that explains it
    └── logprob                      from the root's logits and token ids: per-token log-prob |delta| max and
                                     mean, the K3 estimate of KL, the share of bitwise-equal log-probs

Bands of the relative difference: identical (the same bit patterns: ``bitwise``), same-values (the same
numbers in other bits: another dtype, -0 against +0), equivalent (<= 1e-5), minor (<= 1e-3), large (<= 1e-1), severe. The
measure is quadratic in the error: one bf16 rounding step scores about 1e-5. Origins therefore
ask for the same values, not a band: true on-policy's target is bitwise.

Bad data is never "equivalent". A NaN or Inf on either side puts the tensor in a band of its own,
``non-finite`` (worse than severe), naming how many and where; NaN equals NaN only when both sides
hold NaN at exactly the same places and the caller asked for that (``nan_equal=True``). Log-prob
metrics fail closed: when the token ids, lengths or vocabularies differ, or a value is not finite,
``logprob["comparable"]`` is False and ``logprob["why"]`` says why. Every figure is JSON-safe.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from fx_precision.bit_equality import bit_equal, same_bits
from fx_precision.callable_module import make_callable
from fx_precision.dtypes import dtype_name, parse_dtype
from fx_precision.dump import Dump, DumpRecorder, Record, Sequence, join_ranks, load_dump
from fx_precision.errors import PrecisionError
from fx_precision.logprobs import token_logprobs
from fx_precision.module_graph import module_label

BANDS = (("identical", 0.0), ("equivalent", 1e-5), ("minor", 1e-3), ("large", 1e-1), ("severe", float("inf")))
SAME_VALUES = "same-values"  # the same numbers in other bits: another dtype (fp32 and bf16 holding bf16 values), -0 and +0
NON_FINITE = "non-finite"  # worse than any band: NaN or Inf on a side
BAND_RANK = {"identical": 0, SAME_VALUES: 0.5, **{name: i for i, (name, _) in enumerate(BANDS) if i}, NON_FINITE: len(BANDS)}
MATCHING = ("identical", SAME_VALUES)  # for origins: a match holds the same values (the same bits where the dtypes agree)


def band_of(rel_diff: float, bitwise: bool, same_values: bool | None = None) -> str:
    """``identical`` only where the bit patterns were compared and agree (bit_equality.same_bits); the same numbers in
    other bits ``same-values``; else the band of ``rel_diff``."""
    if bitwise:
        return "identical"
    if same_values:
        return SAME_VALUES
    for name, limit in BANDS[1:]:
        if rel_diff <= limit:
            return name
    return "severe"


@dataclass
class Side:
    """An in-process side: ``model(*args, **kwargs)`` under ``context()`` (e.g. an autocast), recorded
    with inputs and replays, so origins and the op-level drill-down are available."""

    model: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    name: str = ""

    def record(self) -> Dump:
        with torch.no_grad(), self.context(), DumpRecorder(self.model, inputs=True, replay=True) as recorder:
            self.model(*self.args, **self.kwargs)
        recorder.dump.source = self.name or type(self.model).__name__
        return recorder.dump


@dataclass(frozen=True)
class TensorDiff:
    fqn: str
    call: int
    io: str
    path: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    rel_diff: float
    max_abs: float
    mean_abs: float
    rel_diff_narrow: float | None
    bitwise: bool
    band: str
    non_finite: str | None = None  # "a: 1 NaN (first at [0, 3]); b: none": why the band is non-finite
    first_row: int | None = None  # the first row (all dimensions but the last flattened: a token) whose values differ


def _first_row(x: torch.Tensor, y: torch.Tensor) -> int | None:
    """The first row of two same-shaped tensors (every dimension but the last flattened) whose values differ."""
    if x.dim() == 0:
        return None if bool(torch.equal(x, y)) else 0
    rows = (x.reshape(-1, x.shape[-1]) != y.reshape(-1, y.shape[-1])).any(dim=-1).nonzero()
    return int(rows[0, 0]) if rows.numel() else None


def _non_finite(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The mask of NaN/Inf elements and a description (count by kind, the first index)."""
    mask = ~torch.isfinite(t)
    if not bool(mask.any()):
        return mask, "none"
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    first = [int(i) for i in mask.nonzero()[0].tolist()]
    kinds = ", ".join(k for k in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if k)
    return mask, f"{kinds} (first at {first})"


def tensor_diff(a: Record, b: Record, *, nan_equal: bool = False) -> TensorDiff:
    x, y = a.tensor, b.tensor
    assert x is not None and y is not None
    common: dict[str, Any] = {"fqn": a.fqn, "call": a.call, "io": a.io, "path": a.path, "dtype_a": a.dtype, "dtype_b": b.dtype}
    common |= {"shape_a": a.shape, "shape_b": b.shape}
    if x.shape != y.shape:
        return TensorDiff(
            **common, rel_diff=math.inf, max_abs=math.inf, mean_abs=math.inf, rel_diff_narrow=None, bitwise=False, band="severe"
        )
    if not (x.is_floating_point() and y.is_floating_point()):
        same = bool(torch.equal(x, y))
        bits = same and x.dtype == y.dtype  # integers: the same values in the same dtype are the same bits
        band = "identical" if bits else SAME_VALUES if same else "severe"
        return TensorDiff(
            **common, rel_diff=float(not same), max_abs=0.0, mean_abs=0.0, rel_diff_narrow=None, bitwise=bits, band=band,
            first_row=None if same else _first_row(x, y),
        )  # fmt: skip
    mask_x, text_x = _non_finite(x)
    mask_y, text_y = _non_finite(y)
    if bool(mask_x.any()) or bool(mask_y.any()):
        same_places = bool(torch.equal(mask_x, mask_y)) and bool(torch.equal(x[mask_x].isnan(), y[mask_y].isnan()))
        same_places = same_places and bool(torch.equal(x[mask_x & ~x.isnan()], y[mask_y & ~y.isnan()]))  # +Inf vs -Inf
        if not (nan_equal and same_places):
            finite = ~(mask_x | mask_y)
            delta = (x[finite].double() - y[finite].double()).abs()
            return TensorDiff(
                **common,
                rel_diff=math.inf,
                max_abs=float(delta.max()) if delta.numel() else 0.0,
                mean_abs=float(delta.mean()) if delta.numel() else 0.0,
                rel_diff_narrow=None,
                bitwise=False,
                band=NON_FINITE,
                non_finite=f"a: {text_x}; b: {text_y}"
                + ("" if not same_places else " (the same places; nan_equal=True compares the rest)"),
            )
        x, y = x.masked_fill(mask_x, 0.0), y.masked_fill(mask_y, 0.0)  # asked for: equal non-finite places, compare the rest
    x64, y64 = x.double(), y.double()
    rel = _rel(x64, y64)
    delta = (x64 - y64).abs()
    narrow = None
    if x.dtype != y.dtype:
        low = x.dtype if x.dtype.itemsize < y.dtype.itemsize else y.dtype
        narrow = _rel(x.to(low).double(), y.to(low).double())
    bitwise = same_bits(x, y)
    same_values = bitwise or bool(torch.equal(x64, y64))  # fp32 and bf16 holding the very same numbers
    return TensorDiff(
        **common,
        rel_diff=rel,
        max_abs=float(delta.max()) if delta.numel() else 0.0,
        mean_abs=float(delta.mean()) if delta.numel() else 0.0,
        rel_diff_narrow=narrow,
        bitwise=bitwise,
        band=band_of(rel, bitwise, same_values),
        first_row=None if same_values else _first_row(x64, y64),
    )


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    denominator = float((x * x).sum() + (y * y).sum())
    if denominator == 0.0:
        return 0.0
    return max(0.0, 1.0 - 2.0 * float((x * y).sum()) / denominator)


@dataclass
class CallDiff:
    fqn: str
    call: int
    start: int
    inputs_match: bool | None  # None: this side pair has no recorded inputs for the call
    output_band: str
    worst_output: TensorDiff | None
    origin: bool = False


@dataclass
class OpDiff:
    """The first aten op of an origin whose output differs, on both sides."""

    module: str
    index: int
    op_a: str
    op_b: str
    dtype_a: str
    dtype_b: str
    rel_diff: float
    explanation: str


@dataclass
class Comparison:
    pairs: list[TensorDiff]
    calls: list[CallDiff]
    only_a: list[tuple[str, int, str, str]]
    only_b: list[tuple[str, int, str, str]]
    first_op: OpDiff | None = None
    logprob: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def origins(self) -> list[CallDiff]:
        return [c for c in self.calls if c.origin]

    @property
    def first_origin(self) -> CallDiff | None:
        return self.origins[0] if self.origins else None

    @property
    def first_differing(self) -> CallDiff | None:
        return next((c for c in self.calls if c.output_band not in MATCHING), None)

    def to_dict(self) -> dict[str, Any]:
        return json_safe({
            "version": 2,
            "logprob": self.logprob,
            "first_origin": asdict(self.first_origin) if self.first_origin else None,
            "first_op": asdict(self.first_op) if self.first_op else None,
            "origins": [asdict(c) for c in self.origins],
            "first_differing": asdict(self.first_differing) if self.first_differing else None,
            "calls": [asdict(c) for c in self.calls],
            "pairs": [asdict(p) for p in self.pairs],
            "only_a": [list(k) for k in self.only_a],
            "only_b": [list(k) for k in self.only_b],
            "notes": self.notes,
        })  # fmt: skip

    def render(self, top: int = 12) -> str:
        from tabulate import tabulate

        lines = []
        lp = self.logprob
        if lp is not None and not lp["comparable"]:
            lines.append(f"log-prob comparison not made: {lp['why']}")
        elif lp is not None:
            lines.append(
                f"log-prob |delta|: max {lp['max']:.3g}, mean {lp['mean']:.3g}; K3 KL {lp['k3_kl']:.3g}; "
                f"bitwise-equal tokens {lp['bitwise_share']:.1%} of {int(lp['tokens'])}"
            )
            for part in ("prompt", "generated"):
                if lp[part]["tokens"] and lp["generated"]["tokens"]:
                    q = lp[part]
                    lines.append(
                        f"  {part}: max {q['max']:.3g}, mean {q['mean']:.3g}, bitwise {q['bitwise_share']:.1%} of {int(q['tokens'])}"
                    )
            if lp["non_finite"]:
                lines.append(f"  NOT FINITE: {lp['why']}")
        first = self.first_differing
        lines.append(f"first differing module: {module_label(first.fqn) if first else 'none'}")
        origin = self.first_origin
        lines.append(
            f"first origin (inputs match, output differs): {module_label(origin.fqn) + f' (call {origin.call})' if origin else 'none'}"
        )
        if self.first_op:
            op = self.first_op
            where = f"#{op.index} " if op.index >= 0 else "a cast: "
            lines.append(f"first differing op in it: {where}{op.op_a} ({op.dtype_a}) vs {op.op_b} ({op.dtype_b}); {op.explanation}")
        rows = [
            [
                module_label(c.fqn),
                c.call,
                {True: "match", False: "differ", None: "-"}[c.inputs_match],
                c.output_band,
                f"{c.worst_output.rel_diff:.2e}" if c.worst_output else "-",
                f"{c.worst_output.dtype_a}/{c.worst_output.dtype_b}" if c.worst_output else "-",
                ("ORIGIN" if c.origin else ("inherited" if c.output_band not in MATCHING else ""))
                + (f" {c.worst_output.non_finite}" if c.worst_output and c.worst_output.non_finite else ""),
            ]
            for c in self.calls
            if c.output_band not in MATCHING
        ][:top]
        if rows:
            headers = ["module (completion order)", "call", "inputs", "output band", "rel diff", "dtypes a/b", ""]
            lines.append("\n" + tabulate(rows, headers=headers))
        if self.only_a or self.only_b:
            lines.append(f"\non one side only: {len(self.only_a)} tensor(s) in a, {len(self.only_b)} in b")
        lines.extend(self.notes)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# FQN maps
# ---------------------------------------------------------------------------------------------


def parse_fqn_map(text: str | dict[str, str] | None) -> list[tuple[str, str]]:
    """``"self_attn=attn; model.layers.*=layers.*"`` -> [(a pattern, b pattern)]."""
    if not text:
        return []
    if isinstance(text, dict):
        for a, b in text.items():
            if not isinstance(a, str) or not isinstance(b, str) or not a.strip() or not b.strip():
                raise PrecisionError(f"FQN map entry {a!r}: {b!r}: both sides need a name (non-empty strings)")
        return list(text.items())
    if not isinstance(text, str):
        raise PrecisionError(f"fqn_map={text!r}: a text 'a_name=b_name; ...' or a dict {{a_name: b_name}}")
    pairs = []
    for part in re.split(r"[;,]", text):
        if not part.strip():
            continue
        if part.count("=") != 1:
            raise PrecisionError(f"FQN map entry {part.strip()!r}: expected A_NAME=B_NAME (a segment or a glob, e.g. self_attn=attn)")
        a, b = (s.strip() for s in part.split("="))
        if not a or not b:
            raise PrecisionError(f"FQN map entry {part.strip()!r}: both sides need a name")
        pairs.append((a, b))
    return pairs


def _pattern(glob: str) -> re.Pattern[str]:
    body = re.escape(glob).replace(r"\*", r"([^.]+)")
    return re.compile(rf"(^|.+\.){body}(\..+|$)")


def rename(fqn: str, mapping: list[tuple[str, str]]) -> str:
    """Side b's FQN in side a's names: each (a, b) rewrites the segments matching b into a."""
    for a, b in mapping:
        match = _pattern(b).match(fqn)
        if match:
            captured = iter(match.groups()[1:-1])
            a_text = "".join(next(captured, "*") if piece == "*" else piece for piece in re.split(r"(\*)", a))
            fqn = f"{match.group(1)}{a_text}{match.groups()[-1]}"
    return fqn


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------


def _as_dump(side: Any, label: str, notes: list[str]) -> Dump:
    if isinstance(side, Dump):
        return side
    if isinstance(side, Side):
        return side.record()
    if isinstance(side, (str, os.PathLike)):
        loaded = load_dump(side)
        if isinstance(loaded, dict):
            joined, note = join_ranks(loaded)
            notes.append(f"side {label}: {note}")
            return joined
        return loaded
    raise PrecisionError(f"side {label}: a dump directory, a Dump or an fx_precision.Side, got {type(side).__name__}")


def compare(a: Any, b: Any, *, fqn_map: str | dict[str, str] | None = None, drill_down: bool = True, nan_equal: bool = False) -> Comparison:
    """Compare two forwards (see the module docstring). ``fqn_map`` renames side b's modules;
    ``nan_equal``: NaN at exactly the same places on both sides counts as equal there."""
    notes: list[str] = []
    da, db = _as_dump(a, "a", notes), _as_dump(b, "b", notes)
    mapping = parse_fqn_map(fqn_map)
    if mapping:
        names_b = {r.fqn for r in db.records}
        for pa, pb in mapping:
            if not any(_pattern(pb).match(n) for n in names_b):
                raise PrecisionError(f"FQN map {pa}={pb}: {pb!r} matches no module of side b ({db.source}); check the names")
        renamed: dict[str, str] = {}
        for name in sorted(names_b):
            new = rename(name, mapping)
            if new in renamed and renamed[new] != name:
                raise PrecisionError(
                    f"FQN map {fqn_map!r} sends side b's {renamed[new]!r} and {name!r} both to {new!r}; a map must keep modules "
                    "apart: make the patterns more specific"
                )
            renamed[new] = name
        db = replace(  # a renamed copy: the caller's Dump keeps its own names
            db,
            records=[replace(r, fqn=rename(r.fqn, mapping)) for r in db.records],
            calls=[replace(c, fqn=rename(c.fqn, mapping)) for c in db.calls],
            replays={(rename(f, mapping), c): v for (f, c), v in db.replays.items()},
        )
    by_a = {r.key: r for r in da.records if r.io != "logprob"}
    by_b = {r.key: r for r in db.records if r.io != "logprob"}
    pairs = [tensor_diff(by_a[k], by_b[k], nan_equal=nan_equal) for k in by_a if k in by_b]
    result = Comparison(pairs, [], [k for k in by_a if k not in by_b], [k for k in by_b if k not in by_a], notes=notes)
    _judge_calls(result, da, db)
    if not (da.inputs and db.inputs):
        result.notes.append("inputs were not recorded on both sides: origins need them (dump with inputs=True / --inputs)")
    if drill_down and result.first_origin is not None:
        result.first_op = _drill_down(result.first_origin, da, db)
    result.logprob = logprob_metrics(da, db)
    return result


def _judge_calls(result: Comparison, da: Dump, db: Dump) -> None:
    per_call: dict[tuple[str, int], list[TensorDiff]] = {}
    for diff in result.pairs:
        per_call.setdefault((diff.fqn, diff.call), []).append(diff)
    spans = {(c.fqn, c.call): c for c in da.calls}
    order = sorted(spans.values(), key=lambda c: c.end)  # execution order: a call when it completes (children first)
    band_rank = BAND_RANK
    for info in order:
        diffs = per_call.get((info.fqn, info.call), [])
        outputs = [d for d in diffs if d.io == "out"]
        inputs = [d for d in diffs if d.io == "in"]
        worst = max(outputs, key=lambda d: (band_rank[d.band], d.rel_diff), default=None)
        recorded = (da.inputs and db.inputs) or info.fqn == ""
        match = all(d.band in MATCHING for d in inputs) if recorded else None
        result.calls.append(CallDiff(info.fqn, info.call, info.start, match, worst.band if worst else "identical", worst))
    candidates = [c for c in result.calls if c.inputs_match and c.output_band not in MATCHING]
    for call in candidates:
        span = spans[(call.fqn, call.call)]
        inside = [
            o for o in candidates if o is not call and span.start < spans[(o.fqn, o.call)].start and spans[(o.fqn, o.call)].end < span.end
        ]
        call.origin = not inside  # the innermost: a divergence its children already explain is not its own


# ---------------------------------------------------------------------------------------------
# op-level drill-down
# ---------------------------------------------------------------------------------------------

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


def _drill_down(origin: CallDiff, da: Dump, db: Dump) -> OpDiff | None:
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
                rel = _rel(x.double(), y.double())
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
            _rel(made.double().reshape(-1), target.double()),
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


# ---------------------------------------------------------------------------------------------
# log-prob metrics
# ---------------------------------------------------------------------------------------------


def _root_logits_and_ids(dump: Dump) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    logits = ids = None
    for record in dump.records:
        if record.fqn != "" or record.call != 0:
            continue
        if record.io == "out" and record.path in ("out", "out.logits", "out[0]") and logits is None:
            logits = record.tensor
        if record.io == "in" and record.tensor is not None and not record.tensor.is_floating_point() and ids is None:
            ids = record.tensor
    return logits, ids


@dataclass(frozen=True)
class LogprobView:
    """One side's per-token log-probs: per sequence, its token ids, prompt length and fp32 log-probs
    of ``tokens[1:]``; ``vocab`` when they were taken from logits here."""

    sequences: list[Sequence]
    logprobs: list[torch.Tensor]
    vocab: int | None
    origin: str
    prompt_recorded: bool = True  # an engine launched as users launch it returns no prompt log-probs (NaN placeholders)


def logprob_view(dump: Dump) -> LogprobView | None:
    """Recorded log-probs (an engine's), else ``log_softmax(logits.float())`` of the root's logits at
    the root's token ids (each batch row one sequence, all prompt), else None."""
    recorded = dump.logprob_records()
    if recorded and dump.sequences:
        by_index = {r.path: r.tensor for r in recorded}
        values = []
        for i, _ in enumerate(dump.sequences):
            tensor = by_index.get(f"seq[{i}]")
            if tensor is None:
                raise PrecisionError(f"dump {dump.source}: sequence {i} has token ids but no log-prob record seq[{i}]")
            values.append(tensor.double())
        prompt = not isinstance(dump.engine, dict) or bool(dump.engine.get("prompt_logprobs", True))
        return LogprobView(list(dump.sequences), values, None, "recorded", prompt)
    logits, ids = _root_logits_and_ids(dump)
    if logits is None or ids is None or logits.dim() != 3 or ids.dim() != 2 or tuple(ids.shape) != tuple(logits.shape[:2]):
        return None
    lp = token_logprobs(logits, ids)
    sequences = [Sequence(tuple(int(t) for t in row), len(row)) for row in ids.tolist()]
    return LogprobView(sequences, [row.double() for row in lp], int(logits.shape[-1]), "from the root's logits")


def _stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float | None]:
    if a.numel() == 0:  # nothing compared: no share to claim
        return {"max": 0.0, "mean": 0.0, "k3_kl": 0.0, "bitwise_share": None, "tokens": 0.0}
    delta = (a - b).abs()
    log_ratio = b - a
    k3 = (log_ratio.exp() - 1) - log_ratio  # Schulman's K3 estimate of KL(a || b) on a's tokens
    return {
        "max": float(delta.max()),
        "mean": float(delta.mean()),
        "k3_kl": float(k3.mean()),
        "bitwise_share": float(bit_equal(a, b).double().mean()),  # bit patterns: -0.0 is not 0.0
        "tokens": float(delta.numel()),
    }


def _not_comparable(why: str) -> dict[str, Any]:
    return {"comparable": False, "why": why}


def logprob_metrics(da: Dump, db: Dump) -> dict[str, Any] | None:
    """Per-token log-probs, side a vs side b: |delta| max and mean, K3 KL, bitwise-equal share, over
    all tokens and split into prompt and generated ones. ``comparable`` is False (``why`` says why)
    when the token ids, lengths, vocabularies or models differ; ``non_finite`` counts NaN/Inf, over
    which nothing is averaged. None: neither side holds log-probs or logits."""
    va, vb = logprob_view(da), logprob_view(db)
    if va is None and vb is None:
        return None
    for view, label, dump in ((va, "a", da), (vb, "b", db)):
        if view is None:
            return _not_comparable(f"side {label} ({dump.source}) holds no log-probs: no logprob records and no root logits with token ids")
    assert va is not None and vb is not None
    if da.model and db.model and da.model != db.model:
        return _not_comparable(f"the dumps are of different models (a: {da.model}, b: {db.model})")
    if va.vocab is not None and vb.vocab is not None and va.vocab != vb.vocab:
        return _not_comparable(f"the vocabularies differ (a: {va.vocab} logits per token, b: {vb.vocab})")
    if len(va.sequences) != len(vb.sequences):
        return _not_comparable(f"side a has {len(va.sequences)} sequence(s), side b {len(vb.sequences)}")
    for i, (sa, sb) in enumerate(zip(va.sequences, vb.sequences, strict=True)):
        if len(sa.tokens) != len(sb.tokens):
            return _not_comparable(f"sequence {i}: {len(sa.tokens)} tokens on side a, {len(sb.tokens)} on side b")
        if sa.tokens != sb.tokens:
            k = next(j for j, (x, y) in enumerate(zip(sa.tokens, sb.tokens, strict=True)) if x != y)
            return _not_comparable(f"sequence {i}: the token ids differ at position {k} (a: {sa.tokens[k]}, b: {sb.tokens[k]})")
    # which tokens are generated: the side that recorded them knows (an engine's dump); else all are prompt
    prompt_lens = [max(sa.prompt_len if va.origin == "recorded" else 0, sb.prompt_len if vb.origin == "recorded" else 0) or len(sa.tokens)
                   for sa, sb in zip(va.sequences, vb.sequences, strict=True)]  # fmt: skip
    a, b = torch.cat(va.logprobs), torch.cat(vb.logprobs)
    is_generated = torch.cat([torch.arange(1, len(s.tokens)) >= p for s, p in zip(va.sequences, prompt_lens, strict=True)])
    recorded = is_generated | torch.tensor(va.prompt_recorded and vb.prompt_recorded)  # prompt tokens a side did not record: left out
    a, b, is_generated = a[recorded], b[recorded], is_generated[recorded]
    finite = torch.isfinite(a) & torch.isfinite(b)
    result: dict[str, Any] = {"comparable": True, "why": None, **_stats(a[finite], b[finite])}
    result["non_finite"] = int((~finite).sum())
    result["tokens"] = float(a.numel())
    result["prompt"] = _stats(a[finite & ~is_generated], b[finite & ~is_generated])
    result["generated"] = _stats(a[finite & is_generated], b[finite & is_generated])
    kept = va.prompt_recorded and vb.prompt_recorded
    result["prompt_recorded"] = kept
    result["sequences"] = [
        {"tokens": len(s.tokens), "prompt_len": p, "bitwise": same_bits(x if kept else x[p - 1 :], y if kept else y[p - 1 :])}
        for s, p, x, y in zip(va.sequences, prompt_lens, va.logprobs, vb.logprobs, strict=True)
    ]
    result["origin"] = {"a": va.origin, "b": vb.origin}
    if result["non_finite"]:
        result["why"] = f"{result['non_finite']} log-prob(s) are NaN or Inf on a side; the figures are over the finite ones"
    return result


def gate(logprob: dict[str, Any] | None, fail_above: float) -> str | None:
    """Why a ``--fail-above`` gate fails (None: it passes). It fails closed: no comparison, a
    non-finite value or a max |delta| above the limit all fail."""
    if logprob is None:
        return "no log-probs to compare: neither side holds logits with token ids or log-prob records"
    if not logprob.get("comparable"):
        return f"the log-prob comparison could not be made: {logprob.get('why')}"
    if logprob.get("non_finite"):
        return f"{logprob['non_finite']} log-prob(s) are NaN or Inf"
    if logprob["max"] > fail_above:
        return f"log-prob |delta| max {logprob['max']:.3g} > --fail-above {fail_above:g}"
    return None


def json_safe(value: Any) -> Any:
    """Strict JSON: non-finite floats as the strings "NaN", "Infinity", "-Infinity"; tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


make_callable(__name__, compare)  # fxp.compare(...) calls the function; import fx_precision.compare binds this module
