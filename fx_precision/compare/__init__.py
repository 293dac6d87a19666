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

One module per idea: sides.py (what a side is), alignment.py (calls paired by FQN, the FQN map), bands.py (one
tensor pair judged), origins.py, drill_down.py, logprob_metrics.py (and the --fail-above gate), report.py (the
Comparison: its JSON and its table). Equality is bit_equality's: one NaN rule, bit patterns of any float dtype.

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

from typing import Any

from fx_precision.callable_module import make_callable
from fx_precision.compare.alignment import parse_fqn_map, rename, renamed_side
from fx_precision.compare.bands import BAND_RANK, BANDS, MATCHING, NON_FINITE, SAME_VALUES, TensorDiff, band_of, tensor_diff
from fx_precision.compare.drill_down import first_differing_op
from fx_precision.compare.logprob_metrics import LogprobView, gate, logprob_metrics, logprob_view
from fx_precision.compare.origins import judge_calls
from fx_precision.compare.report import CallDiff, Comparison, OpDiff, json_safe
from fx_precision.compare.sides import Side, as_dump

__all__ = [
    "BANDS", "BAND_RANK", "MATCHING", "NON_FINITE", "SAME_VALUES", "CallDiff", "Comparison", "LogprobView", "OpDiff", "Side",
    "TensorDiff", "band_of", "compare", "gate", "json_safe", "logprob_metrics", "logprob_view", "parse_fqn_map", "rename",
    "tensor_diff",
]  # fmt: skip


def compare(a: Any, b: Any, *, fqn_map: str | dict[str, str] | None = None, drill_down: bool = True, nan_equal: bool = False) -> Comparison:
    """Compare two forwards (see the module docstring). ``fqn_map`` renames side b's modules;
    ``nan_equal``: NaN at exactly the same places on both sides counts as equal there."""
    notes: list[str] = []
    da, db = as_dump(a, "a", notes), renamed_side(as_dump(b, "b", notes), fqn_map)
    by_a = {r.key: r for r in da.records if r.io != "logprob"}
    by_b = {r.key: r for r in db.records if r.io != "logprob"}
    pairs = [tensor_diff(by_a[k], by_b[k], nan_equal=nan_equal) for k in by_a if k in by_b]
    result = Comparison(pairs, [], [k for k in by_a if k not in by_b], [k for k in by_b if k not in by_a], notes=notes)
    judge_calls(result, da, db)
    if not (da.inputs and db.inputs):
        result.notes.append("inputs were not recorded on both sides: origins need them (dump with inputs=True / --inputs)")
    if drill_down and result.first_origin is not None:
        result.first_op = first_differing_op(result.first_origin, da, db)
    result.logprob = logprob_metrics(da, db)
    return result


make_callable(__name__, compare)  # fxp.compare(...) calls the function; import fx_precision.compare binds this module
