"""The residual stream across a graph break: fxp_engine::residual_add (bf16 out, its fp32 sum kept in the forward
engine_rows opens), fxp_engine::unrounded_residual (the next graph's norm input: the kept fp32 sum when x is its
rounding, checked, else x.float()), fxp_engine::stored (a value rounded where the engine stores it). Not pure
functions of their tensors: they read and write the forward's state (ContractForward), which lives while engine_rows
is open; outside it they refuse in one line, and a recompute inside it reads the same state (the same bits)."""

from __future__ import annotations

from typing import Any

import torch

from fx_precision.contract.batch_rows import active_forward
from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state
from fx_precision.errors import PrecisionError


def _key(x: torch.Tensor) -> tuple[Any, ...]:
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)


def _sums(op: str) -> dict[tuple[Any, ...], torch.Tensor]:
    """The residual sums of the forward ``engine_rows`` opened (ContractForward): they live for that forward only."""
    forward = active_forward()
    if forward is None:
        raise PrecisionError(
            f"fxp_engine.{op} ran outside fx_precision.contract.batch_rows.engine_rows(...): the fused add + norm hands its "
            "unrounded sum across a graph break within one forward, and a forward under the contract runs inside engine_rows "
            "(a recompute in backward, activation checkpointing, runs the forward again: call backward inside it too)"
        )
    return forward.residual_sums


@torch.library.custom_op("fxp_engine::residual_add", mutates_args=())
def residual_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` in bf16 (the stream), keeping the fp32 sum for the norm of the graph this one leaves to
    (``unrounded_residual``): the engine's fused add + norm normalises that sum, and a graph break
    (an FSDP2 unit, a block compiled alone) falls between the add and the norm."""
    exact = a.float() + b.float()
    out = exact.to(a.dtype)
    _sums("residual_add")[_key(out)] = exact  # kept for the forward's life: a recompute (activation checkpointing) reads it again
    return out


@residual_add.register_fake
def _(a, b):
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype, device=a.device)


def _residual_add_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.shapes = (inputs[0].shape, inputs[1].shape)


def _residual_add_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return grad.sum_to_size(ctx.shapes[0]), grad.sum_to_size(ctx.shapes[1])


residual_add.register_autograd(_residual_add_backward, setup_context=_residual_add_setup)
declare_forward_state(residual_add)


@torch.library.custom_op("fxp_engine::unrounded_residual", mutates_args=())
def unrounded_residual(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32: the fp32 sum ``residual_add`` kept for it when ``x`` is that sum's bf16 rounding
    (checked element by element, so a stale entry is never used), else ``x.float()``. Read, not taken: a recompute of
    the forward (activation checkpointing) inside the same ``engine_rows`` gets the same sum, the same bits."""
    exact = _sums("unrounded_residual").get(_key(x))
    if exact is not None and exact.shape == x.shape and torch.equal(exact.to(x.dtype), x):
        return exact
    return x.float().clone() if x.dtype == torch.float32 else x.float()  # never the input itself: the output is a fresh buffer


@unrounded_residual.register_fake
def _(x):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def _unrounded_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.dtype = inputs[0].dtype


def _unrounded_backward(ctx: OpContext, grad: torch.Tensor) -> torch.Tensor:
    return grad.to(ctx.dtype)  # as x.float()'s: the rounding passes gradients straight through


unrounded_residual.register_autograd(_unrounded_backward, setup_context=_unrounded_setup)
declare_forward_state(unrounded_residual)


@torch.library.custom_op("fxp_engine::stored", mutates_args=())
def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` as a tensor the engine keeps in memory (its bf16 weights, its rotary tables). A cast
    in the graph would do the same in eager mode, but Inductor drops a narrowing cast whose value a fused kernel widens
    again (without emulate_precision_casts, as a compiled engine runs it): behind this op the rounding stays."""
    return x.to(dtype).clone() if x.dtype == dtype else x.to(dtype)


@stored.register_fake
def _(x, dtype):
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _stored_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.dtype = inputs[0].dtype


def _stored_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return grad.to(ctx.dtype), None  # as x.to(dtype)'s: the rounding passes gradients straight through


stored.register_autograd(_stored_backward, setup_context=_stored_setup)
