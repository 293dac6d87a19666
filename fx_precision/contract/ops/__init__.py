"""The ops an engine contract puts into a training graph: opaque to Inductor, differentiable, meta-aware.

    fxp_engine::attention(q, k, v, key_lens, mask, scale, causal, window, q_offset, scores, exp, lane_sum, p_bf16, fma, store,
                          kv_tiles=None)
        forward   attention_kernels.cpp (kernels.py: built at first use): the engine kernel's arithmetic in its order;
                  with AMX, 16 query rows per tile (bitwise the one-row reference, which tests hold); each row's
                  keys in the engine's KV tiles (attention_tiles.py): kv_tiles, else the forward's plan (read
                  from engine_rows, like linear's rows), else one tile
        backward  plain fp32 attention math (softmax recomputed), gradients in the inputs' dtype
    fxp_engine::rotary(x, cos, sin, rounding) -> out
        forward   x1*c - x2*s | x2*c + x1*s in fp32 from bf16 operands, one store (the engine's rounding)
        backward  the exact rotation's transpose: rounding passes gradients straight through
    fxp_engine::linear(x, weight, bias, logits, engine_out, where) -> out
        forward   each row summed in the order of the engine call that computed it (batch_rows.engine_rows,
                  linear_order.py), by linear_kernels.cpp: AMX tiles, work split over outputs, never over K
        backward  the linear's gradients in bf16, as autocast's linear has them
    fxp_engine::residual_add(a, b) -> a + b           a graph's residual sum that leaves the graph: bf16
                                                      out, its fp32 sum kept (in the forward engine_rows opens)
    fxp_engine::unrounded_residual(x) -> fp32         the next graph's norm input: the kept fp32 sum
                                                      when x is its rounding (checked), else x.float()
        state     not pure functions of their tensors: residual_add writes, unrounded_residual reads, and linear
                  (and attention, for its KV tiles when none are passed) reads the forward's state
                  (ContractForward: its row plan and its sums, behind a ContextVar), which lives while
                  engine_rows is open; outside it they refuse in one line. Declared to the compiler as ordered
                  effects (forward_state.py, with gdn, record_routes, inductor_sum_squares and
                  inductor_stream): kept in order,
                  never dropped or recomputed by a pass; a recompute inside engine_rows (activation
                  checkpointing with backward inside it) reads the same state: the same bits
        backward  straight through, as an add's and a cast's
    fxp_engine::eager_math(x, op, dims, keepdim, exponent) -> out
        forward   torch's eager kernel for a reduction (mean, sum) or a transcendental (exp, cos, sin,
                  silu, ...): the engine runs these eagerly, Inductor would sum and approximate otherwise
        backward  the op's derivative in plain torch ops (traced into the backward graph, fused there)

All are ``torch.library`` custom ops with fake kernels, so Dynamo traces them, AOTAutograd
differentiates them, and Inductor calls them as extern kernels: it cannot fuse their fp32 math into
another order or drop their round trips.
"""

from __future__ import annotations

from fx_precision.contract.ops.attention import allowed_mask, attention_reference, engine_attention
from fx_precision.contract.ops.eager_math import EAGER_MATH, eager_layer_norm, eager_math, eager_math_gradient
from fx_precision.contract.ops.linear import engine_linear
from fx_precision.contract.ops.norm_order import inductor_stream, inductor_sum_squares
from fx_precision.contract.ops.residual import residual_add, stored, unrounded_residual
from fx_precision.contract.ops.rotary import engine_rotary, rotate, round_to

__all__ = [
    "EAGER_MATH", "allowed_mask", "attention_reference", "eager_layer_norm", "eager_math", "eager_math_gradient", "engine_attention",
    "engine_linear", "engine_rotary", "inductor_stream", "inductor_sum_squares", "residual_add", "rotate", "round_to", "stored",
    "unrounded_residual",
]  # fmt: skip
