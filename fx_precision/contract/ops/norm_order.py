"""fxp_engine::inductor_sum_squares: a norm's sum of squares in the order the compiled engine's Inductor kernel sums
it (contract/inductor_norms.py: the order bound to the norm module, found by its weight); the backward 2 x grad.
fxp_engine::inductor_stream: the norm's input as that kernel leaves it (rounded where it stores it narrow), found the
same way; the backward passes the gradient through."""

from __future__ import annotations

from typing import Any

import torch

from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state


@torch.library.custom_op("fxp_engine::inductor_sum_squares", mutates_args=())
def inductor_sum_squares(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The sum of ``x``'s squares over its last dim (kept) in the order the compiled engine's kernel sums that norm's
    (contract/inductor_norms.py): the norm is found by its ``weight``; of the stream's rounding where that kernel sums
    the rounding it stored (``summed`` "stored"). Behind an op, Inductor cannot re-vectorise it."""
    from fx_precision.contract.inductor_norms import ordered_sum_squares, reduction_of_weight

    reduction = reduction_of_weight(weight)
    if reduction.summed == "stored" and reduction.stores is not None:  # the kernel sums the rounding it stored before
        x = x.to(getattr(torch, reduction.stores))
    return ordered_sum_squares(x, reduction.lanes, reduction.width)


@inductor_sum_squares.register_fake
def _(x, weight):
    return torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


def _sum_squares_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _sum_squares_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (x,) = ctx.saved_tensors
    return (2 * x.float() * grad).to(x.dtype), None


inductor_sum_squares.register_autograd(_sum_squares_backward, setup_context=_sum_squares_setup)
declare_forward_state(inductor_sum_squares)


@torch.library.custom_op("fxp_engine::inductor_stream", mutates_args=())
def inductor_stream(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The residual stream ``x`` (fp32) as the compiled engine's kernel for the norm of ``weight`` leaves it: rounded
    through the dtype that kernel stores it in (its bound order's ``stores``: the value it normalises and every later
    kernel reads), or ``x`` itself where it stores none (contract/inductor_norms.py). Behind an op, Inductor cannot
    drop the rounding."""
    from fx_precision.contract.inductor_norms import reduction_of_weight

    stores = reduction_of_weight(weight).stores
    if stores is None:
        return x.clone()
    return x.to(getattr(torch, stores)).to(x.dtype)


@inductor_stream.register_fake
def _(x, weight):
    return torch.empty_like(x)


def _stream_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return grad, None  # a rounding passes gradients straight through


inductor_stream.register_autograd(_stream_backward)
declare_forward_state(inductor_stream)
