"""What "bitwise" means in this project, in one place: the same bit pattern, element by element.

    bit_equal(a, b)    elementwise, any dtype: -0.0 is not 0.0, and a NaN equals only a NaN of the same bits
    same_bits(a, b)    one dtype, one shape, every element bit_equal

Every figure built on it counts a non-finite value apart and never as agreement: ``compare``'s bitwise shares are over
finite pairs, with the NaN/Inf count beside them, and its ``--fail-above`` gate fails on any; the on-policy loop's
certificate (onpolicy/metrics.py) counts a token whose log-prob is NaN or Inf on any side as a mismatch.
"""

from __future__ import annotations

import torch

from fx_precision.errors import PrecisionError

_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bit pattern (one dtype). This project's "bitwise" everywhere: -0.0 is not 0.0, and a NaN
    equals only the same NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise PrecisionError(f"bit_equal: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    if not a.is_floating_point():
        return a == b
    kind = _INT_OF[a.element_size()]
    return a.contiguous().view(kind) == b.contiguous().view(kind)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(bit_equal(a, b).all())
