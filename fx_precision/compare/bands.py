"""One tensor pair judged: dtypes, shapes, the relative difference in fp64, max / mean |x - y|, bitwise (bit patterns,
``bit_equality``) and its band: identical, same-values, equivalent, minor, large, severe, non-finite."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fx_precision.bit_equality import same_bits
from fx_precision.dump import Record

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
    rel = relative_difference(x64, y64)
    delta = (x64 - y64).abs()
    narrow = None
    if x.dtype != y.dtype:
        low = x.dtype if x.dtype.itemsize < y.dtype.itemsize else y.dtype
        narrow = relative_difference(x.to(low).double(), y.to(low).double())
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


def relative_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    denominator = float((x * x).sum() + (y * y).sum())
    if denominator == 0.0:
        return 0.0
    return max(0.0, 1.0 - 2.0 * float((x * y).sum()) / denominator)
