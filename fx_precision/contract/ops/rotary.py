"""fxp_engine::rotary: x1*c - x2*s | x2*c + x1*s in fp32 from bf16 operands, one store (the engine's rounding);
the backward is the exact rotation's transpose (the rounding passes gradients straight through). ``rotate`` is the
reference the op and the probes share."""

from __future__ import annotations

from typing import Any

import torch

from fx_precision.contract.op_context import OpContext
from fx_precision.contract.vocabulary import Rounding


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x1*c - x2*s | x2*c + x1*s in fp32 (neox layout: the halves of cos / sin are equal). With bf16
    operands each product is exact in fp32, so a fused multiply-add rounds the same: one rounding, the sum's."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[..., :half].float(), sin[..., :half].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: int) -> torch.Tensor:
    """fp32 -> bf16 by rounding to nearest even (0) or truncating (1: ``Rounding.TRUNCATE.code``)."""
    if rounding == Rounding.TRUNCATE.code and dtype == torch.bfloat16:
        x = (x.contiguous().view(torch.int32) & -65536).view(torch.float32)  # the low 16 bits dropped: exact below
    return x.to(dtype)


@torch.library.custom_op("fxp_engine::rotary", mutates_args=())
def engine_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rounding: int) -> torch.Tensor:
    """Rotary position embedding as the engine's CPU kernel computes it: fp32 math, one bf16 store."""
    return round_to(rotate(x, cos, sin), x.dtype, rounding).contiguous()  # the fake's layout


@engine_rotary.register_fake
def _(x, cos, sin, rounding):
    return torch.empty(torch.broadcast_shapes(x.shape, cos.shape), dtype=x.dtype, device=x.device)


def _rotary_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, cos, sin, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype


def _rotary_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    cos, sin = ctx.saved_tensors
    half = grad.shape[-1] // 2
    g1, g2 = grad[..., :half].float(), grad[..., half:].float()
    c, s = cos[..., :half].float(), sin[..., :half].float()
    gx = torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), dim=-1)  # the rotation's transpose; rounding straight through
    gx = gx.sum_to_size(ctx.x_shape) if tuple(gx.shape) != tuple(ctx.x_shape) else gx
    return gx.to(ctx.x_dtype), None, None, None


engine_rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup)
