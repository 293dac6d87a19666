"""fxp_engine::attention: the engine's CPU attention in its arithmetic and order (the kernel: attention_kernels.cpp via
kernels.py; KV tiles from the forward's row plan or ``kv_tiles``), its reference (``attention_reference``: plain fp32
attention) beside it, which the backward differentiates."""

from __future__ import annotations

import functools
from typing import Any

import torch

from fx_precision.contract.batch_rows import active_rows
from fx_precision.contract.kernels import attention_variant, engine_kernels
from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state
from fx_precision.errors import PrecisionError


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
    merge_fma: bool = True,
) -> torch.Tensor:
    """q [B, T, H, D], k / v [B, S, KVH, D] (bf16), key_lens [B], mask [B, 1|H, T, S] or None: attention as the engine
    computes it, in the arithmetic the named arguments select (``AttentionArithmetic.op_args``), each row's keys in
    the KV tiles and split-KV parts the engine took them in: ``kv_tiles`` [B, T, N, 4] (``kernels.attention``), else
    the forward's (``engine_rows``), else one tile per row."""
    out_dtype = q.dtype
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    variant = attention_variant(scores, exp, lane_sum, p_bf16, fma, store, merge_fma)
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
def _(q, k, v, key_lens, mask, scale, causal, window, q_offset, scores, exp, lane_sum, p_bf16, fma, store, kv_tiles=None, merge_fma=True):
    return q.new_empty(q.shape)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lens: torch.Tensor, mask: torch.Tensor | None,
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
    probs, vf = attention_reference(q, k, v, key_lens, mask if ctx.has_mask else None, scale, causal, window, q_offset)
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
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), *([None] * 14)


engine_attention.register_autograd(_attention_backward, setup_context=_attention_setup)
declare_forward_state(engine_attention)
