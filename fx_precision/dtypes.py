"""Dtype names as users write them (``fp32``, ``bf16``, ``fp16``) and as tables print them."""

from __future__ import annotations

import torch

from fx_precision.errors import PrecisionError

NAME_TO_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in NAME_TO_DTYPE.items()}
_EXTRA_NAMES: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2",
}
_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; ``None`` -> ``"-"``."""
    if dtype is None:
        return "-"
    return DTYPE_TO_NAME.get(dtype) or _EXTRA_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype, *, what: str = "dtype") -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    key = name.strip().lower()
    if key in NAME_TO_DTYPE:
        return NAME_TO_DTYPE[key]
    if key in _ALIASES:
        return _ALIASES[key]
    for dtype, text in _EXTRA_NAMES.items():
        if text == key:
            return dtype
    raise PrecisionError(f"{what}: unknown dtype {name!r}; use one of {', '.join(NAME_TO_DTYPE)}")


def optional_dtype(value: str | torch.dtype | None, *, what: str = "dtype") -> torch.dtype | None:
    """``parse_dtype`` of a value that may be None (no dtype on that axis: autocast off, masters as loaded)."""
    return None if value is None else parse_dtype(value, what=what)


def is_analysed_float(dtype: torch.dtype) -> bool:
    """Floating dtypes the precision contract speaks about (not float8, not complex)."""
    return dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)


AXIS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # master, gather, reduce
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)  # what torch.autocast runs; at fp32 or fp64 it disables itself


def axis_dtype(value: str | torch.dtype, what: str, allowed: tuple[torch.dtype, ...] = AXIS_DTYPES) -> torch.dtype:
    """``value`` as a dtype of a precision axis, or a ``PrecisionError`` naming ``what`` and listing ``allowed``."""
    dtype = parse_dtype(value, what=what)
    if dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise PrecisionError(f"{what}={dtype_name(dtype)}: this axis takes {names}")
    return dtype
