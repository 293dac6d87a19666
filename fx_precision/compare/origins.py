"""Origins: the calls whose recorded inputs match and whose output does not, innermost first (a call whose inputs
already differ inherits the divergence; a call whose children explain it is not its own)."""

from __future__ import annotations

from fx_precision.compare.bands import BAND_RANK, MATCHING, TensorDiff
from fx_precision.compare.report import CallDiff, Comparison
from fx_precision.dump import Dump


def judge_calls(result: Comparison, da: Dump, db: Dump) -> None:
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
