"""The compute axis as torch.autocast holds it: entering it for a dtype, and reading the ambient one.

    autocast_context(bf16, "cuda")     torch.autocast("cuda", dtype=bf16)   (None: no autocast)
    ambient_compute(["cpu", "cuda"])   (bf16, "cpu") for the first enabled autocast, else (None, None)

Shared by the policy (forward_context), lint and the backend (the compute dtype a graph was traced
under) and the passes (re-propagating dtypes under the graph's autocast state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from fx_precision.errors import PrecisionError


def device_kind(device_type: str | torch.device) -> str:
    """``"cuda:1"`` / ``torch.device("cuda", 1)`` -> ``"cuda"``."""
    return device_type.type if isinstance(device_type, torch.device) else str(device_type).split(":")[0]


def autocast_context(compute: torch.dtype | None, device_type: str | torch.device = "cpu") -> contextlib.AbstractContextManager[Any]:
    if compute is None:
        return contextlib.nullcontext()
    kind = device_kind(device_type)
    if kind == "meta":
        raise PrecisionError("autocast has no meta device type; pass the device type whose op lists should apply (cpu or cuda)")
    return torch.autocast(kind, dtype=compute)


def ambient_compute(device_types: Sequence[str]) -> tuple[torch.dtype | None, str | None]:
    """The dtype of the first enabled ambient autocast among ``device_types``, and that device type."""
    for device_type in device_types:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type), device_type
    return None, None
