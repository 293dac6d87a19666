"""fxp_engine::inductor_sum_squares: a norm's sum of squares in the order the compiled engine's Inductor kernel sums
it (contract/inductor_norms.py: the order bound to the norm module, found by its weight); the backward 2 x grad."""

from __future__ import annotations

from typing import Any

import torch

from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state


@torch.library.custom_op("fxp_engine::inductor_sum_squares", mutates_args=())
def inductor_sum_squares(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The sum of ``x``'s squares over its last dim (kept) in the order the compiled engine's kernel sums that norm's
    (contract/inductor_norms.py): the norm is found by its ``weight``. Behind an op, Inductor cannot re-vectorise it."""
    from fx_precision.contract.inductor_norms import ordered_sum_squares, reduction_of_weight

    reduction = reduction_of_weight(weight)
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
