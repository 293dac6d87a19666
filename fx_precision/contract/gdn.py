"""GatedDeltaNet (Qwen3-Next, Qwen3.5 linear attention) as the rollout engine computes it, and the ops that put it into a
training graph.

What one linear-attention layer of the engine does with a step's tokens (vLLM 0.32's CPU path, read off its source and
held to its binary: tests/engine/test_gdn.py)::

    the conv's input x [T, C] (q | k | v channels), a, b [T, Hv] (bf16, from the projections)
    ├── prefilled tokens, per request piece (a prompt, a chunk of one, a first chunk of one token)
    │     conv      torch's F.conv1d on bf16 [K - 1 stored inputs (zeros for a new request) ++ the piece], then F.silu
    │               on its bf16 output: two roundings (the torch fallback vLLM runs where the CPU lacks AVX-512 BF16)
    │     gating    fused_gdn_gating_cpu: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (gdn_kernels.cpp)
    │     rule      chunk_gated_delta_rule_cpu: q / k l2-normalised, chunks of 64 from the piece's first token, the WY
    │               form; the state from the request's previous piece (zero for a new request)
    └── decoded tokens (one per request and step, with a state), in turn
          conv      causal_conv1d_update: fp32 sum of K products, silu in fp32, one rounding
          gating    the decode kernel's own (log1pf softplus, beta in bf16 arithmetic)
          rule      fused_sigmoid_gating_delta_rule_update_cpu: the per-token recurrence
    then          RMSNormGated (fp32: x * rsqrt(mean(x^2) + eps) * w * silu(z), one rounding), out_proj

The split the engine ran, which tokens each step prefilled and in which pieces, which it decoded, is the dump's (the
rollout records every step's rows): ``batch_rows`` turns it into a code per row (``GDN_DECODE``, or the first row of
the piece that prefilled it), which ``fxp_engine.gdn`` reads from the forward's plan, as ``fxp_engine.linear`` reads
its rows. Followed: the engine's portable kernel build (``_C_AVX2``: every x86 CPU runs it; ``rollout --isa avx2`` runs
it on an AVX-512 CPU), the arithmetic above (gdn_kernels.cpp); its AVX-512 build without BF16 (``_C_AVX512``, what an
AVX-512 CPU without AVX512-BF16 loads; ``rollout --isa avx512``): the same generic code, the decode recurrence's three
multiply-adds fused by the compiler (``PORTABLE_FMA``); and its AVX-512 build on an AVX-512 BF16 CPU (``_C``, as
users launch it there: gdn_avx512_kernels.cpp, the ``*512`` calls): the C++ conv on packed weights for prefilled and
decoded tokens alike (VDPBF16PS tap pairs, fast_silu), the gating's vector heads in blocks of 32 (exp_u20, SLEEF's log,
VRCP14PS), the chunk rule's GEMMs through libtorch's own brgemm (the function the engine calls: VDPBF16PS here, AMX tiles
on an AMX CPU), the decode kernel's fused multiply-adds, an fp32 state.

    GdnForm                 what the probe read: the kernel build, the state cache's dtype, eps (gdn_form.py)
    gdn_forward(x, a, b, plan, GdnLayer)   one layer's core for a batch, piece by piece (the op's forward)
    gdn_reference(...)      the same in plain differentiable fp32 torch, every token through one chunked recurrence
                            (the op's backward differentiates it: gradients close to the model's own, not bitwise)
    fxp_engine::gdn         conv + gating + delta rule of one layer: [B, C, T] conv input -> [B, T, Hv, D]
    fxp_engine::gated_rms_norm   vLLM's RMSNormGated.forward_native in torch's eager kernels
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fx_precision.contract.batch_rows import GDN_DECODE, GDN_NONE, active_forward
from fx_precision.contract.gdn_form import AVX512, CHUNK, HEAD_DIMS, PORTABLE, PORTABLE_FMA, GdnForm
from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state
from fx_precision.errors import PrecisionError

# GDN_DECODE: a row the engine's decode kernel computed (one token of a request that had a state); GDN_NONE: a row the
# engine never computed (the last sampled token, padding); else the first row of the piece that prefilled the row
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


# ---------------------------------------------------------------------------------------------
# the kernels (gdn_kernels.cpp), tensor level
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _lib() -> Any:
    lib = engine_kernels().lib
    i, f = ctypes.c_int, ctypes.c_float
    lib.fxp_gdn_gating.argtypes = [_P, _P, _P, _P, _I64, _I64, i, _P, _P]
    lib.fxp_gdn_chunk.argtypes = [_P, _P, _P, _P, _P, _P, i, _P, _I64, _I64, _I64, _I64, f]
    lib.fxp_gdn_decode.argtypes = [_P, _P, _P, _P, _P, _P, i, i, _P, _I64, _I64, _I64, _I64, f]
    lib.fxp_gdn_conv_decode.argtypes = [_P, _P, _P, _I64, _I64, _P]
    lib.fxp_gdn_decode_run.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, i, i, _P, _I64, _I64, _I64, _I64, _I64, _I64, f]
    lib.fxp_gdn512_conv.argtypes = [_P, _P, _P, _I64, _I64, _P]
    lib.fxp_gdn512_gating.argtypes = [_P, _P, _P, _P, _I64, _I64, _P, _P]
    lib.fxp_gdn512_decode.argtypes = [_P] * 8 + [_I64] * 4 + [_P]
    lib.fxp_gdn512_chunk.argtypes = [_P] * 6 + [_I64] * 4 + [f, _P]
    for name in ("fxp_gdn_gating", "fxp_gdn_chunk", "fxp_gdn_decode", "fxp_gdn_conv_decode", "fxp_gdn_decode_run", "fxp_gdn512_conv",
                 "fxp_gdn512_gating", "fxp_gdn512_decode", "fxp_gdn512_chunk"):  # fmt: skip
        getattr(lib, name).restype = None
    return lib


def _lib512() -> Any:
    """The kernels of the engine's AVX-512 build (gdn_avx512_kernels.cpp), refused in one line where this CPU cannot run
    them: they call the CPU's own VRCP14PS and torch's 16-lane SLEEF log, as the engine does."""
    kernels = engine_kernels()
    if not torch.cpu._is_avx512_supported() or kernels.sleef_logf16 is None:
        raise PrecisionError(
            "the engine ran its AVX-512 GatedDeltaNet kernels (vLLM's _C build), which use this CPU's VRCP14PS and torch's AVX-512 "
            "SLEEF log: this CPU (or this torch) has no AVX-512; run the training side on the engine's CPU family, or roll out "
            "with --isa avx2"
        )
    return _lib()


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *, decode: bool,
           kernels: str = PORTABLE) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(g fp32, beta bf16) of [T, Hv] a / b, as the engine's prefill gating (``decode=False``) or decode kernel computes them
    (``kernels``: the engine's build; the AVX-512 build's decode kernel gates inside ``decode512``)."""
    a16, b16, A = _bf16(a), _bf16(b), _f32(A_log)
    T, Hv = a16.shape
    g = torch.empty(T, Hv, dtype=torch.float32)
    beta = torch.empty(T, Hv, dtype=torch.bfloat16)
    if kernels == AVX512 and not decode:
        dt16 = _bf16(dt_bias)
        _lib512().fxp_gdn512_gating(_ptr(a16), _ptr(b16), _ptr(A), _ptr(dt16), T, Hv, _ptr(g), _ptr(beta))
        return g, beta
    dt = _f32(dt_bias)
    _lib().fxp_gdn_gating(_ptr(a16), _ptr(b16), _ptr(A), _ptr(dt), T, Hv, int(decode), _ptr(g), _ptr(beta))
    return g, beta


def chunk512(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
             eps: float) -> torch.Tensor:  # fmt: skip
    """``chunk_rule`` as the engine's AVX-512 build computes it (fp32 state, updated in place)."""
    q16, k16, v16, g32, b16 = _bf16(q), _bf16(k), _bf16(v), _f32(g), _bf16(beta)
    L, H, D = q16.shape
    Hv = v16.shape[1]
    _check_state(state, Hv, D)
    out = torch.empty(L, Hv, D, dtype=torch.bfloat16)
    _lib512().fxp_gdn512_chunk(_ptr(q16), _ptr(k16), _ptr(v16), _ptr(g32), _ptr(b16), _ptr(state), L, H, Hv, D, eps, _ptr(out))
    return out


def decode512(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """B decoded tokens through the AVX-512 build's decode kernel, its gating inside: [B, H, D] q / k, [B, Hv, D] v, [B, Hv]
    a / b; ``state`` [B, Hv, D, D] fp32, updated in place. Returns [B, Hv, D] bf16."""
    q16, k16, v16, a16, b16, A, dt16 = _bf16(q), _bf16(k), _bf16(v), _bf16(a), _bf16(b), _f32(A_log), _bf16(dt_bias)
    B, H, D = q16.shape
    Hv = v16.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape) != (B, Hv, D, D):
        raise PrecisionError(f"gdn decode: the state must be [B, Hv, D, D] = {(B, Hv, D, D)} fp32 contiguous, got {tuple(state.shape)}")
    out = torch.empty(B, Hv, D, dtype=torch.bfloat16)
    _lib512().fxp_gdn512_decode(_ptr(q16), _ptr(k16), _ptr(v16), _ptr(a16), _ptr(b16), _ptr(A), _ptr(dt16), _ptr(state), B, H, Hv, D,
                                _ptr(out))  # fmt: skip
    return out


def conv512(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The AVX-512 build's conv (prefill piece or decoded token alike): ``x`` [L, C] bf16 after ``history`` [K - 1, C] (the
    request's stored inputs, oldest first; zeros for a new one), ``weight`` [C, 4]. Returns [L, C] bf16."""
    x16, h16, w16 = _bf16(x), _bf16(history), _bf16(weight)
    L, C = x16.shape
    if tuple(w16.shape) != (C, 4) or tuple(h16.shape) != (3, C) or C % 32:
        raise PrecisionError(f"gdn conv (AVX-512 build): the engine packs width-4 weights over channels in blocks of 32, got "
                             f"weight {tuple(w16.shape)}, history {tuple(h16.shape)}; roll out with --isa avx2 (its portable "
                             "build) for other conv shapes")  # fmt: skip
    out = torch.empty(L, C, dtype=torch.bfloat16)
    _lib512().fxp_gdn512_conv(_ptr(x16), _ptr(h16), _ptr(w16), L, C, _ptr(out))
    return out


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
               state_bf16: bool, eps: float) -> torch.Tensor:  # fmt: skip
    """One request piece's prefilled tokens ([L, H, D] q / k, [L, Hv, D] v, [L, Hv] g / beta) through the chunk kernel;
    ``state`` ([Hv, D, D] fp32, contiguous) is updated in place. Returns [L, Hv, D] bf16."""
    q16, k16, v16, g32, b16 = _bf16(q), _bf16(k), _bf16(v), _f32(g), _bf16(beta)
    L, H, D = q16.shape
    Hv = v16.shape[1]
    _check_state(state, Hv, D)
    out = torch.empty(L, Hv, D, dtype=torch.bfloat16)
    _lib().fxp_gdn_chunk(_ptr(q16), _ptr(k16), _ptr(v16), _ptr(g32), _ptr(b16), _ptr(state), int(state_bf16), _ptr(out), L, H, Hv, D, eps)
    return out


def decode_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                state_bf16: bool, eps: float, kernels: str = PORTABLE) -> torch.Tensor:  # fmt: skip
    """B decoded tokens ([B, H, D] q / k, [B, Hv, D] v, [B, Hv] g / beta), each with its own state ([B, Hv, D, D] fp32,
    updated in place), through the decode kernel's recurrence as the ``kernels`` build computes it (``PORTABLE_FMA``: its
    multiply-adds fused). Returns [B, Hv, D] bf16."""
    q16, k16, v16, g32, b16 = _bf16(q), _bf16(k), _bf16(v), _f32(g), _bf16(beta)
    B, H, D = q16.shape
    Hv = v16.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape) != (B, Hv, D, D):
        raise PrecisionError(f"gdn decode: the state must be [B, Hv, D, D] = {(B, Hv, D, D)} fp32 contiguous, got {tuple(state.shape)}")
    out = torch.empty(B, Hv, D, dtype=torch.bfloat16)
    _lib().fxp_gdn_decode(_ptr(q16), _ptr(k16), _ptr(v16), _ptr(g32), _ptr(b16), _ptr(state), int(state_bf16), int(kernels == PORTABLE_FMA),
                          _ptr(out), B, H, Hv, D, eps)  # fmt: skip
    return out


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token's conv ([C] bf16) from ``conv_state`` ([C, K - 1] bf16, oldest first; shifted in place); [C] bf16."""
    x16, w16 = _bf16(x), _bf16(weight)
    C, K = w16.shape
    if conv_state.dtype != torch.bfloat16 or not conv_state.is_contiguous() or tuple(conv_state.shape) != (C, K - 1):
        raise PrecisionError(f"gdn conv: the conv state must be [C, K - 1] = {(C, K - 1)} bf16 contiguous, got {tuple(conv_state.shape)}")
    out = torch.empty(C, dtype=torch.bfloat16)
    _lib().fxp_gdn_conv_decode(_ptr(x16), _ptr(conv_state), _ptr(w16), C, K, _ptr(out))
    return out


def _check_state(state: torch.Tensor, Hv: int, D: int) -> None:
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape) != (Hv, D, D):
        raise PrecisionError(f"gdn: the state must be [Hv, D, D] = {(Hv, D, D)} fp32 contiguous, got {tuple(state.shape)}")


# ---------------------------------------------------------------------------------------------
# one layer of a batch, piece by piece
# ---------------------------------------------------------------------------------------------


def prefill_conv(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The engine's prefill conv of one piece: ``x`` [C, L] bf16 after ``history`` [C, K - 1] (the request's stored
    inputs, zeros for a new one), through torch's own bf16 F.conv1d and F.silu on the shapes vLLM gives them (the
    vector width of torch's silu decides which elements its tail computes: the same tensors give the same bits)."""
    C = weight.shape[0]
    conv_input = torch.cat([history.unsqueeze(0), x.unsqueeze(0)], dim=-1).to(torch.bfloat16)
    out = F.conv1d(conv_input, weight.to(torch.bfloat16).unsqueeze(1), None, padding=0, groups=C)
    out = out[..., -x.shape[-1] :].to(torch.bfloat16)
    return F.silu(out).squeeze(0)  # [C, L]


def _pieces(plan: list[int]) -> list[tuple[str, int, int]]:
    """A row's plan as runs: ("prefill", start, end) per piece, ("decode", start, end) per run of decoded rows, ("none",
    start, end) for rows the engine never computed. A prefilled row's code is its piece's first row."""
    runs: list[tuple[str, int, int]] = []
    t = 0
    while t < len(plan):
        code = plan[t]
        end = t + 1
        if code >= 0:
            if code != t:
                raise PrecisionError(f"gdn plan: row {t} is in the piece starting at row {code}, which is not where its run starts")
            while end < len(plan) and plan[end] == code:
                end += 1
            runs.append(("prefill", t, end))
        else:
            kind = "decode" if code == GDN_DECODE else "none"
            if code not in (GDN_DECODE, GDN_NONE):
                raise PrecisionError(f"gdn plan: row {t} holds {code}, neither a piece's first row nor a decoded or uncomputed row")
            while end < len(plan) and plan[end] == code:
                end += 1
            runs.append((kind, t, end))
        t = end
    return runs


@dataclass(frozen=True)
class GdnLayer:
    """What one GatedDeltaNet layer's core reads besides its rows: the conv ``weight`` ([C, 1, K] or [C, K]), ``A_log``
    and ``dt_bias`` ([Hv]), its key heads, and the form's state dtype (``state_bf16``) and ``eps``."""

    weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    key_heads: int
    state_bf16: bool
    eps: float
    kernels: str = PORTABLE


def gdn_forward(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: torch.Tensor, layer: GdnLayer) -> torch.Tensor:
    """One GatedDeltaNet layer's core as the engine computed each row (module docstring). ``x``: the conv's input
    [B, C, T]; ``a``, ``b``: [B, T, Hv]; ``plan``: [B, T] int32 (``GDN_DECODE``, ``GDN_NONE`` or the first row of a row's
    prefill piece). Returns [B, T, Hv, D] bf16 (zeros where never computed)."""
    weight, A_log, dt_bias, key_heads, state_bf16, eps = (layer.weight, layer.A_log, layer.dt_bias, layer.key_heads, layer.state_bf16,
                                                           layer.eps)  # fmt: skip
    B, C, T = x.shape
    Hv = a.shape[-1]
    w = _bf16(weight.reshape(C, -1))
    K = w.shape[1]
    D = (C // (2 * key_heads + Hv)) if C % (2 * key_heads + Hv) == 0 else 0
    if D not in HEAD_DIMS or (C - Hv * D) != 2 * key_heads * D or Hv % key_heads:
        raise PrecisionError(f"gdn: {C} conv channels, {key_heads} key heads and {Hv} value heads give no head dim the engine runs "
                             f"({', '.join(map(str, HEAD_DIMS))}; q / k / v heads of one dim)")  # fmt: skip
    A, dt = _f32(A_log), _f32(dt_bias)
    xs, a16, b16 = _bf16(x), _bf16(a), _bf16(b)
    out = torch.zeros(B, T, Hv, D, dtype=torch.bfloat16)
    qk = key_heads * D
    if layer.kernels == AVX512:
        if state_bf16 or K != 4:
            raise PrecisionError(f"fxp_engine.gdn (GdnForm kernels 'avx512'): the contract follows the engine's AVX-512 build with "
                                 f"an fp32 state and conv width 4, got a {'bf16' if state_bf16 else 'fp32'} state and width {K}; "
                                 "roll out with --isa avx2 (its portable build, followed at any width and state)")  # fmt: skip
        for row in range(B):
            out[row] = _row512(xs[row], a16[row], b16[row], plan[row], w, A_log, dt_bias, key_heads, eps)
        return out
    for row in range(B):
        state = torch.zeros(Hv, D, D, dtype=torch.float32)
        for kind, start, end in _pieces([int(c) for c in plan[row].tolist()]):
            if kind == "none":
                continue
            history = torch.zeros(C, K - 1, dtype=torch.bfloat16)
            lo = max(start - (K - 1), 0)
            history[:, K - 1 - (start - lo) :] = xs[row, :, lo:start]
            if kind == "prefill":
                mixed = prefill_conv(xs[row, :, start:end], history, w).t().contiguous()  # [L, C]
                g, beta = gating(a16[row, start:end], b16[row, start:end], A, dt, decode=False)
                q = mixed[:, :qk].reshape(-1, key_heads, D)
                k = mixed[:, qk : 2 * qk].reshape(-1, key_heads, D)
                v = mixed[:, 2 * qk :].reshape(-1, Hv, D)
                out[row, start:end] = chunk_rule(q, k, v, g, beta, state, state_bf16, eps)
            else:
                run = xs[row, :, start:end].t().contiguous()  # [n, C]
                conv_state = history.contiguous()
                ar, br = a16[row, start:end].contiguous(), b16[row, start:end].contiguous()
                got = torch.empty(end - start, Hv, D, dtype=torch.bfloat16)
                _lib().fxp_gdn_decode_run(_ptr(run), _ptr(conv_state), _ptr(w), _ptr(ar), _ptr(br), _ptr(A), _ptr(dt), _ptr(state),
                                          int(state_bf16), int(layer.kernels == PORTABLE_FMA), _ptr(got), end - start, C, K, key_heads,
                                          Hv, D, eps)  # fmt: skip
                out[row, start:end] = got
    return out


def _row512(xs: torch.Tensor, a16: torch.Tensor, b16: torch.Tensor, plan: torch.Tensor, w: torch.Tensor, A_log: torch.Tensor,
            dt_bias: torch.Tensor, key_heads: int, eps: float) -> torch.Tensor:  # fmt: skip
    """One sequence ([C, T] conv input) through the AVX-512 build's kernels, piece by piece and token by token."""
    C, T = xs.shape
    Hv = a16.shape[-1]
    D = C // (2 * key_heads + Hv)
    qk = key_heads * D
    out = torch.zeros(T, Hv, D, dtype=torch.bfloat16)
    state = torch.zeros(Hv, D, D, dtype=torch.float32)
    tokens = xs.t().contiguous()  # [T, C]

    def history(start: int) -> torch.Tensor:  # the request's last three inputs before ``start``, oldest first (zeros before it)
        kept = torch.zeros(3, C, dtype=torch.bfloat16)
        lo = max(start - 3, 0)
        kept[3 - (start - lo) :] = tokens[lo:start]
        return kept

    def split(mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (mixed[:, :qk].reshape(-1, key_heads, D), mixed[:, qk : 2 * qk].reshape(-1, key_heads, D),
                mixed[:, 2 * qk :].reshape(-1, Hv, D))  # fmt: skip

    for kind, start, end in _pieces([int(c) for c in plan.tolist()]):
        if kind == "prefill":
            q, k, v = split(conv512(tokens[start:end], history(start), w))
            g, beta = gating(a16[start:end], b16[start:end], A_log, dt_bias, decode=False, kernels=AVX512)
            out[start:end] = chunk512(q, k, v, g, beta, state, eps)
        elif kind == "decode":
            for t in range(start, end):
                q, k, v = split(conv512(tokens[t : t + 1], history(t), w))
                one = state.unsqueeze(0)  # a view: the kernel updates the state in place
                out[t] = decode512(q, k, v, a16[t : t + 1], b16[t : t + 1], A_log, dt_bias, one)[0]
    return out


def gdn_reference(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  key_heads: int, eps: float) -> torch.Tensor:  # fmt: skip
    """The layer's core in plain fp32 torch (differentiable): causal conv + silu, gating, l2-normalised q / k, the gated
    delta rule over every token in chunks of 64 (the WY form). [B, T, Hv, D] fp32."""
    B, C, T = x.shape
    Hv = a.shape[-1]
    D = C // (2 * key_heads + Hv)
    w = weight.reshape(C, 1, -1).float()
    K = w.shape[-1]
    mixed = F.silu(F.conv1d(F.pad(x.float(), (K - 1, 0)), w, None, groups=C)).transpose(1, 2)  # [B, T, C]
    qk = key_heads * D
    q = mixed[..., :qk].reshape(B, T, key_heads, D)
    k = mixed[..., qk : 2 * qk].reshape(B, T, key_heads, D)
    v = mixed[..., 2 * qk :].reshape(B, T, Hv, D)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # [B, T, Hv]
    beta = torch.sigmoid(b.float())
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * D**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    group = Hv // key_heads
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))  # heads first: [B, Hv, T, ...]
    pad = (-T) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // CHUNK
    q, k, v = (t.reshape(B, Hv, n, CHUNK, D) for t in (q, k, v))
    g, beta = g.reshape(B, Hv, n, CHUNK), beta.reshape(B, Hv, n, CHUNK)
    gc = g.cumsum(-1)
    lower = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool))
    decay = torch.where(lower, (gc.unsqueeze(-1) - gc.unsqueeze(-2)).clamp(max=0.0), torch.full((), -float("inf"))).exp()
    strict = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool), -1)
    A = torch.where(strict, -(beta.unsqueeze(-1) * (k @ k.transpose(-1, -2))) * decay, torch.zeros(()))
    eye = torch.eye(CHUNK)
    Tinv = torch.linalg.solve_triangular(eye - A, eye.expand_as(A), upper=False)
    w_ = Tinv @ (k * (beta * gc.exp()).unsqueeze(-1))
    u = Tinv @ (v * beta.unsqueeze(-1))
    P = torch.where(lower, q @ k.transpose(-1, -2), torch.zeros(())) * decay
    state = x.new_zeros(B, Hv, D, D, dtype=torch.float32)
    outs = []
    for c in range(n):
        v2 = u[:, :, c] - w_[:, :, c] @ state
        outs.append((q[:, :, c] * gc[:, :, c].exp().unsqueeze(-1)) @ state + P[:, :, c] @ v2)
        last = gc[:, :, c, -1:]
        state = state * last.exp().unsqueeze(-1) + (k[:, :, c] * (last - gc[:, :, c]).exp().unsqueeze(-1)).transpose(-1, -2) @ v2
    out = torch.stack(outs, dim=2).reshape(B, Hv, n * CHUNK, D)[:, :, :T]
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fxp_engine::gdn", mutates_args=())
def engine_gdn(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               key_heads: int, state_bf16: bool, eps: float, kernels: str, where: str) -> torch.Tensor:  # fmt: skip
    """One GatedDeltaNet layer's conv, gating and delta rule as the engine computed each row (module docstring), the rows'
    pieces read from the forward's plan (``batch_rows.engine_rows``: ``EngineRows.gdn``). [B, C, T] -> [B, T, Hv, D]."""
    forward = active_forward()
    plan = forward.rows.gdn if forward is not None else None
    if plan is None:
        raise PrecisionError(
            f"fxp_engine.gdn at {where or '<root>'} ran outside fx_precision.contract.batch_rows.engine_rows(...) with a GatedDeltaNet "
            "plan: the engine prefilled some tokens in pieces and decoded others one by one, each its own arithmetic, so a forward "
            "under the contract needs the plan of its batch (a recompute in backward runs the forward again: call backward inside it too)"
        )
    if tuple(plan.shape) != (x.shape[0], x.shape[2]):
        raise PrecisionError(f"fxp_engine.gdn at {where or '<root>'}: the plan is {tuple(plan.shape)}, the batch "
                             f"{(x.shape[0], x.shape[2])}")  # fmt: skip
    return gdn_forward(x, a, b, plan, GdnLayer(weight, A_log, dt_bias, key_heads, state_bf16, eps, kernels)).to(x.dtype)


@engine_gdn.register_fake
def _(x, weight, a, b, A_log, dt_bias, key_heads, state_bf16, eps, kernels, where):
    B, C, T = x.shape
    Hv = a.shape[-1]
    return x.new_empty((B, T, Hv, C // (2 * key_heads + Hv)))


def _gdn_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, a, b, A_log, dt_bias, key_heads, _state_bf16, eps, _kernels, _where = inputs
    ctx.save_for_backward(x, weight, a, b, A_log, dt_bias)
    ctx.key_heads, ctx.eps = key_heads, eps


def _gdn_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The reference's gradients (fp32 math over every token), in the inputs' dtypes: the engine's pieces and roundings
    pass straight through."""
    saved = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_() for t in saved]
        x, weight, a, b, A_log, dt_bias = leaves
        out = gdn_reference(x, weight, a, b, A_log, dt_bias, ctx.key_heads, ctx.eps)
        grads = torch.autograd.grad(out, leaves, grad.float(), allow_unused=True)
    return (*(g.to(t.dtype) if g is not None else None for g, t in zip(grads, saved, strict=True)), None, None, None, None, None)


engine_gdn.register_autograd(_gdn_backward, setup_context=_gdn_setup)
declare_forward_state(engine_gdn)


@torch.library.custom_op("fxp_engine::gated_rms_norm", mutates_args=())
def engine_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNormGated (norm before the gate, silu) as its forward_native runs: torch's eager kernels in fp32,
    ``x * rsqrt(mean(x^2) + eps) * w * silu(z)``, one rounding to x's dtype."""
    xf, zf, wf = x.float(), z.float(), weight.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    out = xf * torch.rsqrt(variance + eps)
    out = out * wf
    out = out * F.silu(zf)
    return out.to(x.dtype)


@engine_gated_rms_norm.register_fake
def _(x, z, weight, eps):
    return torch.empty_like(x)


def _gated_norm_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, z, weight, eps = inputs
    ctx.save_for_backward(x, z, weight)
    ctx.eps = eps


def _gated_norm_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, z, weight = ctx.saved_tensors
    with torch.enable_grad():
        xf, zf, wf = (t.detach().float().requires_grad_() for t in (x, z, weight))
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps) * wf * F.silu(zf)
        gx, gz, gw = torch.autograd.grad(out, (xf, zf, wf), grad.float())
    return gx.to(x.dtype), gz.to(z.dtype), gw.to(weight.dtype), None


engine_gated_rms_norm.register_autograd(_gated_norm_backward, setup_context=_gated_norm_setup)


__all__ = ["CHUNK", "GDN_DECODE", "GDN_NONE", "GdnForm", "engine_gated_rms_norm", "engine_gdn", "gdn_forward", "gdn_reference"]
