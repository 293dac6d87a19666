"""fxp_engine::linear: each row summed in the order of the engine call that computed it (batch_rows.engine_rows,
linear_order.py; a row the call summed apart, by its index in the call: LinearCall.apart) by the linear kernels
(linear_kernels.cpp: AMX tiles, work split over outputs, never over K); the backward is the linear's gradients in
bf16, as autocast's linear has them."""

from __future__ import annotations

import functools
from typing import Any

import torch

from fx_precision.contract.batch_rows import NOT_PLANNED, EngineRows, active_rows
from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.linear_order import LinearCall, LinearOrder
from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state
from fx_precision.errors import PrecisionError


@functools.lru_cache(maxsize=512)
def _order_struct(order: LinearOrder) -> Any:
    return order.struct()


def _row_call(rows: EngineRows, widths: list[int], in_features: int, count: int, where: str) -> LinearCall:
    """The call the engine computed ``count`` rows of this linear in (its fused GEMM's where it is one)."""
    call = next((c for w in widths if (c := rows.orders.call_for(w, in_features, count)) is not None), None)
    if call is None:
        raise PrecisionError(
            f"engine contract: the engine's linear {widths[-1]}x{in_features} at {where or '<root>'} computed rows in a call of "
            f"{count} rows, and the rollout read no summation order for that call (read: {rows.orders.describe()}); roll out "
            "again with fx-precision rollout of this version, which probes every call the run makes"
        )
    return call


def _rows_apart(rows: EngineRows, call: LinearCall, logits: bool, index: torch.Tensor | None,
                where: str) -> list[tuple[torch.Tensor, LinearOrder]]:  # fmt: skip
    """The rows of a group (``index``: their flat rows in the batch; None: every row) that their engine call summed apart
    (``call.apart``), by their index in it (the plan's ``body_at`` / ``logits_at``), each with its order."""
    if not call.apart:
        return []
    at = rows.logits_at if logits else rows.body_at
    flat_at = None if at is None else (at.reshape(-1) if index is None else at.reshape(-1).index_select(0, index))
    if flat_at is None or bool((flat_at == NOT_PLANNED).any()):
        raise PrecisionError(f"fxp_engine.linear at {where or '<root>'}: the engine summed some rows of a {call.rows}-row call apart "
                             "(LinearCall.apart), and the row plan holds no row indices for them; plan the batch with "
                             "batch_rows.row_plans, which records each row's index in its engine call")  # fmt: skip
    picked = [((flat_at == row).nonzero().flatten(), order) for row, order in call.apart]
    return [(p, order) for p, order in picked if p.numel()]


@torch.library.custom_op("fxp_engine::linear", mutates_args=())
def engine_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logits: bool, engine_out: int,
                  where: str) -> torch.Tensor:  # fmt: skip
    """bf16 linear as the engine computes it: each row summed in the order of the engine call that computed it
    (``batch_rows.engine_rows``; the call's weight is ``engine_out`` wide where the engine fuses this linear with
    its siblings, e.g. q, k, v into one qkv GEMM), whatever this process's thread count. Rows the engine never
    computed (padding, the last sampled token) are torch's linear."""
    rows = active_rows()
    if rows is None:
        raise PrecisionError(
            f"fxp_engine.linear at {where or '<root>'} ran outside fx_precision.contract.batch_rows.engine_rows(...): the engine's "
            "GEMM sums each row in an order that depends on the call that computed it, so a forward under the contract needs the "
            "row plan of its batch (a recompute in backward, activation checkpointing, runs the forward again: call backward "
            "inside it too)"
        )
    flat_x = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    plan = (rows.logits if logits else rows.body).reshape(-1)
    if plan.numel() != flat_x.shape[0]:
        raise PrecisionError(
            f"fxp_engine.linear at {where or '<root>'}: the row plan holds {plan.numel()} rows ({tuple(rows.body.shape)}), the linear "
            f"{flat_x.shape[0]}: set engine_rows for the batch this forward runs"
        )
    out_features, in_features = weight.shape
    widths = [w for w in (engine_out, rows.fused.get(where, 0), out_features) if w]  # the fused engine GEMM's, else its own
    w16 = weight.to(torch.bfloat16)

    def computed(part: torch.Tensor, count: int, index: torch.Tensor | None) -> torch.Tensor:
        if count == 0:
            return torch.nn.functional.linear(part, w16, bias.to(torch.bfloat16) if bias is not None else None)
        call = _row_call(rows, widths, in_features, count, where)
        out = engine_kernels().linear(part, w16, bias, _order_struct(call.order))
        for picked, order in _rows_apart(rows, call, logits, index, where):
            out.index_copy_(0, picked, engine_kernels().linear(part.index_select(0, picked), w16, bias, _order_struct(order)))
        return out

    groups = rows.logits_groups if logits else rows.body_groups
    if len(groups) == 1:  # one engine call size for every row
        return computed(flat_x.contiguous(), groups[0][0], None).reshape(*x.shape[:-1], out_features).to(x.dtype)
    out = torch.empty((flat_x.shape[0], out_features), dtype=torch.bfloat16)
    for count, index in groups:
        out.index_copy_(0, index, computed(flat_x.index_select(0, index), count, index))
    return out.reshape(*x.shape[:-1], out_features).to(x.dtype)


@engine_linear.register_fake
def _(x, weight, bias, logits, engine_out, where):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias = inputs[:3]
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight = ctx.saved_tensors  # the batched kernel's gradients, as autocast's bf16 linear has them
    grad_x = grad.matmul(weight.to(grad.dtype))
    flat_g, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_w = flat_g.t().matmul(flat_x.to(grad.dtype))
    grad_b = flat_g.sum(0) if ctx.has_bias else None
    return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b, None, None, None


engine_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
declare_forward_state(engine_linear)
