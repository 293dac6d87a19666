"""The ops an engine contract puts into a training graph: opaque to Inductor, differentiable, meta-aware.

    fxp_engine::attention(q, k, v, key_lens, mask, scale, causal, window, q_offset, scores, exp, lane_sum, p_bf16, fma, store,
                          kv_tiles=None)
        forward   engine_kernels.cpp (kernels.py: built at first use): the engine kernel's arithmetic in its order;
                  with AMX, 16 query rows per tile (bitwise the one-row reference, which tests hold); each row's
                  keys in the engine's KV tiles (attention_tiles.py): kv_tiles, else the forward's plan (read
                  from engine_rows, like linear's rows), else one tile
        backward  plain fp32 attention math (softmax recomputed), gradients in the inputs' dtype
    fxp_engine::rotary(x, cos, sin, rounding) -> out
        forward   x1*c - x2*s | x2*c + x1*s in fp32 from bf16 operands, one store (the engine's rounding)
        backward  the exact rotation's transpose: rounding passes gradients straight through
    fxp_engine::linear(x, weight, bias, logits, engine_out, where) -> out
        forward   each row summed in the order of the engine call that computed it (batch_rows.engine_rows,
                  linear_order.py), by engine_kernels.cpp: AMX tiles, work split over outputs, never over K
        backward  the linear's gradients in bf16, as autocast's linear has them
    fxp_engine::residual_add(a, b) -> a + b           a graph's residual sum that leaves the graph: bf16
                                                      out, its fp32 sum kept (in the forward engine_rows opens)
    fxp_engine::unrounded_residual(x) -> fp32         the next graph's norm input: the kept fp32 sum
                                                      when x is its rounding (checked), else x.float()
        state     not pure functions of their tensors: residual_add writes, unrounded_residual reads, and linear
                  reads the forward's state (ContractForward: its row plan and its sums), which lives while
                  engine_rows is open; outside it they refuse in one line. A recompute inside it (activation
                  checkpointing with backward inside engine_rows) reads the same state: the same bits
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

import functools
from typing import Any

import torch

from fx_precision.contract.batch_rows import EngineRows, active_forward, active_rows
from fx_precision.contract.kernels import attention_variant, engine_kernels
from fx_precision.contract.linear_order import LinearOrder
from fx_precision.contract.op_context import OpContext
from fx_precision.contract.vocabulary import Rounding
from fx_precision.errors import PrecisionError

# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def allowed_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask as ``[B, 1|H, T, S]`` booleans (True: attend). An additive mask may hold only 0 (attend)
    and very negative values (masked): biases (ALiBi) are not an engine-attention mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | blocked).all()):
        raise PrecisionError(
            "engine attention: the additive mask carries biases (values other than 0 and -inf); the engine contract covers "
            "causal, sliding-window and padding masks only"
        )
    return ~blocked


@torch.library.custom_op("fxp_engine::attention", mutates_args=())
def engine_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lens: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int,
    q_offset: int,
    scores: str,
    exp: str,
    lane_sum: str,
    p_bf16: bool,
    fma: bool,
    store: str,
    kv_tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, T, H, D], k / v [B, S, KVH, D] (bf16), key_lens [B], mask [B, 1|H, T, S] or None: attention as the engine
    computes it, in the arithmetic the named arguments select (``AttentionArithmetic.op_args``), each row's keys in
    the KV tiles and split-KV parts the engine took them in: ``kv_tiles`` [B, T, N, 4] (``kernels.attention``), else
    the forward's (``engine_rows``), else one tile per row."""
    out_dtype = q.dtype
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    variant = attention_variant(scores, exp, lane_sum, p_bf16, fma, store)
    if scores == "amx":
        _require_amx()
    allowed = allowed_mask(mask)
    if allowed is not None:
        allowed = allowed.expand(q.shape[0], allowed.shape[1], q.shape[1], k.shape[1])
        allowed, causal = _mask_as_range(allowed, key_lens, causal, window, q_offset)
    tiles = kv_tiles if kv_tiles is not None else _forward_kv_tiles(q, q_offset)
    out = engine_kernels().attention(q16, k16, v16, key_lens, allowed, scale, causal, window, q_offset, variant, kv_tiles=tiles)
    return out.to(out_dtype)


def _forward_kv_tiles(q: torch.Tensor, q_offset: int) -> torch.Tensor | None:
    """The KV tiles of the forward ``engine_rows`` opened, [B, T, N, 4], where its plan has them (None: one tile per row)."""
    rows = active_rows()
    if rows is None or rows.kv_tiles is None:
        return None
    if q_offset != 0 or tuple(rows.kv_tiles.shape[:2]) != tuple(q.shape[:2]):  # [B, T, N, 4]
        raise PrecisionError(
            f"fxp_engine.attention: the forward's KV tiles are planned for {tuple(rows.kv_tiles.shape[:2])} rows from position 0, the "
            f"attention holds {tuple(q.shape[:2])} from {q_offset}: set engine_rows for the batch this forward runs"
        )
    return rows.kv_tiles


def _mask_as_range(
    allowed: torch.Tensor, key_lens: torch.Tensor, causal: bool, window: int, q_offset: int
) -> tuple[torch.Tensor | None, bool]:
    """(None, True) where the mask is the causal range itself (transformers hands sdpa its causal mask as a
    tensor), (None, causal) where it blocks nothing inside the kernel's range: the same keys, and the kernel
    reads no mask. Keys past a row's length count as blocked either way."""
    T, S = allowed.shape[-2:]
    pos = torch.arange(T)[:, None] + q_offset
    keys = torch.arange(S)[None, :]
    inside = (keys < key_lens.cpu()[:, None, None, None]) & ((keys >= pos - window) if window >= 0 else True)
    causal_range = inside & (keys <= pos)
    if causal:
        return (None, True) if bool((allowed | ~causal_range).all()) else (allowed, True)
    if torch.equal(allowed & inside, causal_range.expand_as(allowed)):
        return None, True
    return (None, False) if bool((allowed | ~inside).all()) else (allowed, False)


@functools.lru_cache(maxsize=1)
def _require_amx() -> None:
    """The amx arithmetic runs the engine's AMX instruction: this CPU must have it, and the process
    permission to use its tiles (Linux asks for it once per process)."""
    if not engine_kernels().cpu_has_amx():
        raise PrecisionError(
            "the engine contract's attention is AMX (the engine ran AMX tiles), and this CPU has no AMX: run the training "
            "side where the engine ran, or probe an engine on this machine"
        )
    if not torch._C._cpu._init_amx():
        raise PrecisionError("the kernel could not get this process's permission to use AMX tiles (arch_prctl XCOMP_PERM)")


@engine_attention.register_fake
def _(q, k, v, key_lens, mask, scale, causal, window, q_offset, scores, exp, lane_sum, p_bf16, fma, store, kv_tiles=None):
    return q.new_empty(q.shape)


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lens: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, causal: bool, window: int, q_offset: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fp32 attention with the same masks: probabilities [B, H, T, S] and values [B, S, H, D] (GQA expanded)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(heads // kv_heads, dim=2)
    vf = v.float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) * scale
    t = torch.arange(q.shape[1], device=q.device)[:, None] + q_offset
    s = torch.arange(k.shape[1], device=q.device)[None, :]
    allowed = s < key_lens.to(q.device)[:, None, None, None]
    if causal:
        allowed = allowed & (s <= t)
    if window >= 0:
        allowed = allowed & (s >= t - window)
    extra = allowed_mask(mask)
    if extra is not None:
        allowed = allowed & extra.to(q.device)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs, vf


def _attention_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, key_lens, mask, scale, causal, window, q_offset = inputs[:9]
    ctx.save_for_backward(q, k, v, key_lens, mask if mask is not None else torch.empty(0))
    ctx.has_mask = mask is not None
    ctx.options = (scale, causal, window, q_offset)


def _attention_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, key_lens, mask = ctx.saved_tensors
    scale, causal, window, q_offset = ctx.options
    probs, vf = _attention_reference(q, k, v, key_lens, mask if ctx.has_mask else None, scale, causal, window, q_offset)
    heads, kv_heads = q.shape[2], k.shape[2]
    g = grad.float()
    grad_v = torch.einsum("bhts,bthd->bshd", probs, g)
    grad_p = torch.einsum("bthd,bshd->bhts", g, vf)
    grad_s = probs * (grad_p - (grad_p * probs).sum(-1, keepdim=True))
    kf = k.float().repeat_interleave(heads // kv_heads, dim=2)
    grad_q = torch.einsum("bhts,bshd->bthd", grad_s, kf) * scale
    grad_k = torch.einsum("bhts,bthd->bshd", grad_s, q.float()) * scale
    fold = heads // kv_heads  # GQA: each key/value head collects its query heads' gradients
    grad_k = grad_k.reshape(*grad_k.shape[:2], kv_heads, fold, -1).sum(3)
    grad_v = grad_v.reshape(*grad_v.shape[:2], kv_heads, fold, -1).sum(3)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), *([None] * 13)


engine_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


# ---------------------------------------------------------------------------------------------
# rotary
# ---------------------------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
    return round_to(_rotate(x, cos, sin), x.dtype, rounding).contiguous()  # the fake's layout


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


# ---------------------------------------------------------------------------------------------
# linear: every row in the order of the engine call that computed it
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _order_struct(order: LinearOrder) -> Any:
    return order.struct()


def _row_order(rows: EngineRows, widths: list[int], in_features: int, count: int, where: str) -> LinearOrder:
    order = next((o for w in widths if (o := rows.orders.order_for(w, in_features, count)) is not None), None)
    if order is None:
        raise PrecisionError(
            f"engine contract: the engine's linear {widths[-1]}x{in_features} at {where or '<root>'} computed rows in a call of "
            f"{count} rows, and the rollout read no summation order for that call (read: {rows.orders.describe()}); roll out "
            "again with fx-precision rollout of this version, which probes every call the run makes"
        )
    return order


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

    def computed(part: torch.Tensor, count: int) -> torch.Tensor:
        if count == 0:
            return torch.nn.functional.linear(part, w16, bias.to(torch.bfloat16) if bias is not None else None)
        return engine_kernels().linear(part, w16, bias, _order_struct(_row_order(rows, widths, in_features, count, where)))

    groups = rows.logits_groups if logits else rows.body_groups
    if len(groups) == 1:  # one engine call size for every row
        return computed(flat_x.contiguous(), groups[0][0]).reshape(*x.shape[:-1], out_features).to(x.dtype)
    out = torch.empty((flat_x.shape[0], out_features), dtype=torch.bfloat16)
    for count, index in groups:
        out.index_copy_(0, index, computed(flat_x.index_select(0, index), count))
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


# ---------------------------------------------------------------------------------------------
# the residual stream across a graph break: the unrounded sum a fused add + norm normalises
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# math the engine runs as torch's eager kernels: reductions and transcendental functions
# ---------------------------------------------------------------------------------------------

_UNARY: dict[str, Any] = {
    "exp": torch.exp,
    "log": torch.log,
    "cos": torch.cos,
    "sin": torch.sin,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "rsqrt": torch.rsqrt,
    "erf": torch.erf,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
}
EAGER_MATH = frozenset({*_UNARY, "mean", "sum", "pow"})


def _eager(x: torch.Tensor, op: str, dims: list[int], keepdim: bool, exponent: float) -> torch.Tensor:
    if op == "mean":
        return x.mean(dims, keepdim=keepdim) if dims else x.mean()
    if op == "sum":
        return x.sum(dims, keepdim=keepdim) if dims else x.sum()
    if op == "pow":
        return x.pow(exponent)
    return _UNARY[op](x)


@torch.library.custom_op("fxp_engine::eager_math", mutates_args=())
def eager_math(x: torch.Tensor, op: str, dims: list[int], keepdim: bool, exponent: float) -> torch.Tensor:
    """``op`` by torch's eager kernel. The engine computes its norms' mean of squares, its rotary tables
    and its activations with these; Inductor's generated code sums in another order and uses other
    exp / cos / sin approximations (one fp32 ulp apart on ~10-30% of values, enough to flip a bf16
    rounding now and then), so a compiled graph keeps the eager kernel here."""
    return _eager(x, op, dims, keepdim, exponent).clone(memory_format=torch.contiguous_format)  # fresh, in the fake's layout


@eager_math.register_fake
def _(x, op, dims, keepdim, exponent):
    shaped = _eager(torch.empty_like(x, device="meta"), op, dims, keepdim, exponent)
    return torch.empty(shaped.shape, dtype=shaped.dtype, device=x.device)


def _expand_reduced(grad: torch.Tensor, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if dims and not keepdim:
        for d in sorted(d % x.dim() for d in dims):
            grad = grad.unsqueeze(d)
    return grad.expand(x.shape)


def eager_math_gradient(x: torch.Tensor, grad: torch.Tensor, op: str, dims: list[int], keepdim: bool, exponent: float) -> torch.Tensor:
    """The gradient of ``eager_math`` at ``x``, in plain torch ops: AOTAutograd traces them into the backward
    graph and Inductor fuses them there (only the forward has to be the engine's arithmetic)."""
    if op in ("mean", "sum"):
        wide = _expand_reduced(grad, x, dims, keepdim)
        if op == "mean":
            wide = wide / (x.numel() // max(1, grad.numel()))
        return wide.to(x.dtype)
    if op in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh" if op == "gelu_tanh" else "none")
    if op == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    derivative = {
        "exp": lambda: x.exp(),
        "log": lambda: x.reciprocal(),
        "cos": lambda: -x.sin(),
        "sin": lambda: x.cos(),
        "tanh": lambda: 1 - x.tanh() ** 2,
        "sigmoid": lambda: x.sigmoid() * (1 - x.sigmoid()),
        "rsqrt": lambda: -0.5 * x.rsqrt() ** 3,
        "erf": lambda: (2 / torch.pi**0.5) * torch.exp(-x * x),
        "pow": lambda: exponent * x.pow(exponent - 1),
    }[op]
    return (grad * derivative()).to(x.dtype)


def _eager_math_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.args = inputs[1:]


def _eager_math_grad(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (x,) = ctx.saved_tensors
    return eager_math_gradient(x, grad, *ctx.args), None, None, None, None


eager_math.register_autograd(_eager_math_grad, setup_context=_eager_math_setup)


@torch.library.custom_op("fxp_engine::eager_layer_norm", mutates_args=())
def eager_layer_norm(x: torch.Tensor, shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` by torch's eager kernel (its mean and variance in its order; Inductor's ``var_mean``
    sums in another)."""
    return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)


@eager_layer_norm.register_fake
def _(x, shape, weight, bias, eps):
    return torch.empty_like(x)


@torch.library.custom_op("fxp_engine::eager_layer_norm_backward", mutates_args=())
def eager_layer_norm_backward(
    x: torch.Tensor, grad: torch.Tensor, shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> list[torch.Tensor]:
    """Gradients of ``eager_layer_norm`` for (x, weight, bias) by torch's layer-norm backward kernel (absent
    parts as empty tensors)."""
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
    mask = [True, weight is not None, bias is not None]
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias, mask)
    return [gx, gw if gw is not None else x.new_empty(0), gb if gb is not None else x.new_empty(0)]


@eager_layer_norm_backward.register_fake
def _(x, grad, shape, weight, bias, eps):
    return [torch.empty_like(t) if t is not None else x.new_empty(0) for t in (x, weight, bias)]


def _layer_norm_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, shape, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.shape, ctx.eps, ctx.present = shape, eps, (weight is not None, bias is not None)


def _layer_norm_grad(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias = ctx.saved_tensors
    gx, gw, gb = torch.ops.fxp_engine.eager_layer_norm_backward(x, grad.contiguous(), ctx.shape, weight, bias, ctx.eps)
    return gx, None, gw if ctx.present[0] else None, gb if ctx.present[1] else None, None


eager_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


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
