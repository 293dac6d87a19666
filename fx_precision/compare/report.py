"""What a comparison found, and how it reads: per-call results (``CallDiff``), the first differing op (``OpDiff``), the
``Comparison`` (origins, JSON, the table), strict JSON (``json_safe``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from fx_precision.compare.bands import MATCHING, TensorDiff
from fx_precision.module_graph import module_label


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
            apart = [(i, s["first_differing_token"]) for i, s in enumerate(lp["sequences"]) if s["first_differing_token"]]
            if apart:
                shown = "; ".join(f"{i} from token {d['position']} (|delta| {d['delta']:.3g})" for i, d in apart[:8])
                more = f"; {len(apart) - 8} more" if len(apart) > 8 else ""
                lines.append(f"  sequences not bitwise: {shown}{more}")
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


def json_safe(value: Any) -> Any:
    """Strict JSON: non-finite floats as the strings "NaN", "Infinity", "-Infinity"; tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
