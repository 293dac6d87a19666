"""The GatedDeltaNet probe: vLLM's own GDN kernels against the contract's (contract/gdn.py), bit for bit, at the model's
head counts and dims, its SSM state's dtype and the kernel build this engine loaded.

    gdn_config_refusal(config)   why the engine cannot run, or the contract cannot follow, a GDN hybrid of this
                                 config, read off the config before anything starts (None: it can try)
    gdn_layers(model)      the engine's linear-attention layers (QwenGatedDeltaNetAttention: Qwen3-Next, Qwen3.5)
    probe_gdn(model, kernels, gen) -> (GdnForm | None, evidence, engine record)
        the build          the portable one (_C_AVX2, conv by torch), the AVX-512 one without BF16 (_C_AVX512: the portable
                           code compiled for AVX-512, its decode recurrence's multiply-adds fused), or the AVX-512 one (_C on
                           an AVX-512 BF16 CPU: packed C++ conv, fp32 state, its GEMMs libtorch's brgemm, on AMX tiles where
                           the CPU has them); another is refused, said why
        the kernels        prefill gating, the chunk rule (pieces of 1, 33, 64, 130 tokens, with and without a state, more
                           than one request in a call), the decode kernel (three rows), the conv's decode update and its
                           prefill (vLLM's torch fallback, or its C++ kernels on packed weights), each against the
                           contract's on random inputs
Nothing here runs what this CPU cannot: every op probed is the engine's own, loaded in this process.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from fx_precision.contract.evidence import CandidateEvidence, keeping
from fx_precision.contract.gdn_form import AVX512, HEAD_DIMS, KERNELS, PORTABLE, PORTABLE_FMA, GdnForm
from fx_precision.engines.vllm.cpu_family import PORTABLE_BUILD  # its GDN ops: generic lanes, glibc, no FMA

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PORTABLE_FMA_BUILD = "_C_AVX512"  # the AVX-512 library without BF16 (its GDN ops: the same generic lanes, GCC's FMAs)
AVX512_BUILD = "(_C)"  # the AVX-512 + AVX512-BF16 library (its GDN ops: 16 lanes, exp_u20, VRCP14PS, libtorch's brgemm)
EPS = 1e-5  # vLLM's chunk-kernel wrapper default and the decode kernel's constant


LAYER_TYPES = ("linear_attention", "full_attention")  # the layers vLLM's Qwen3-Next and Qwen3.5 build


def gdn_config_refusal(config: PretrainedConfig) -> str | None:
    """Why a GatedDeltaNet hybrid of ``config`` cannot be rolled out under the contract, in one line (None: no GDN layer,
    or nothing known to refuse): a layer pattern vLLM does not build, linear head dims its CPU chunk kernel refuses
    ("Unexpected head dim size"), value heads that are no multiple of the key heads, a Qwen3-Next without an MoE layer
    (vLLM's Qwen3-Next model needs one)."""
    text = getattr(config, "text_config", None) or config
    types = getattr(text, "layer_types", None)
    if not isinstance(types, (list, tuple)) or "linear_attention" not in types:
        return None
    where = f"{getattr(text, 'model_type', 'the model')} config"
    layers = int(getattr(text, "num_hidden_layers", len(types)) or len(types))
    odd = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if odd or len(types) != layers:
        return (f"{where}: layer_types must name each of its {layers} layers one of {', '.join(LAYER_TYPES)}, got {len(types)} "
                f"entries{' including ' + ', '.join(odd) if odd else ''}")  # fmt: skip
    dims = {
        "linear_key_head_dim": getattr(text, "linear_key_head_dim", None),
        "linear_value_head_dim": getattr(text, "linear_value_head_dim", None),
    }
    if any(d not in HEAD_DIMS for d in dims.values()) or len(set(dims.values())) != 1:
        shown = ", ".join(f"{k} {v}" for k, v in dims.items())
        return f"{where}: {shown}: vLLM's CPU GatedDeltaNet kernels take one head dim for both, {' or '.join(map(str, HEAD_DIMS))}"
    heads, value_heads = int(getattr(text, "linear_num_key_heads", 0) or 0), int(getattr(text, "linear_num_value_heads", 0) or 0)
    if heads < 1 or value_heads % heads:
        return f"{where}: linear_num_value_heads {value_heads} must be a multiple of linear_num_key_heads {heads}"
    if getattr(text, "model_type", None) == "qwen3_next":
        experts, step = int(getattr(text, "num_experts", 0) or 0), int(getattr(text, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(text, "mlp_only_layers", None) or [])
        if experts < 1 or not any(i not in dense and (i + 1) % step == 0 for i in range(layers)):
            return (f"{where}: no MoE layer (num_experts {experts}, decoder_sparse_step {step}, mlp_only_layers {sorted(dense)}): "
                    "vLLM's Qwen3-Next model needs at least one")  # fmt: skip
    return None


def gdn_layers(model: Any) -> list[tuple[str, Any]]:
    """The engine's GatedDeltaNet layers, by what they hold (a conv state and an SSM state in one cache, key and value
    heads of their own)."""
    return [(name, m) for name, m in model.named_modules()
            if all(hasattr(m, a) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size"))]  # fmt: skip


def probe_gdn(model: Any, kernels: str, gen: torch.Generator) -> tuple[GdnForm | None, CandidateEvidence | None, dict[str, Any]]:
    """(form, evidence, the dump's engine record ``gdn``); (None, None, {}) for a model without GDN layers."""
    layers = gdn_layers(model)
    if not layers:
        return None, None, {}
    name, layer = layers[0]
    heads, value_heads = int(layer.num_k_heads), int(layer.num_v_heads)
    dim, value_dim, width = int(layer.head_k_dim), int(layer.head_v_dim), int(layer.conv_kernel_size)
    state = getattr(layer, "kv_cache", None)
    state_dtype = state[1].dtype if isinstance(state, (tuple, list)) and len(state) == 2 else None
    state_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(state_dtype, str(state_dtype)) if state_dtype is not None else "none"
    record = {"layers": [n for n, _ in layers], "key_heads": heads, "value_heads": value_heads, "head_dim": dim, "conv_width": width,
              "state": state_name, "kernels": kernels}  # fmt: skip
    build = _build_followed(kernels, state_dtype)
    why = build if build not in KERNELS else _not_followed(dim, value_dim, state_dtype)
    if why or state_dtype is None:
        return None, CandidateEvidence(why=why or "the engine's layer holds no SSM state", details={"layer": name}), record
    form = GdnForm(build, state_name, EPS)
    try:
        differ = (_differing512(heads, value_heads, dim, gen) if build == AVX512
                  else _differing(heads, value_heads, dim, width, state_dtype, gen, build))  # fmt: skip
    except Exception as exc:  # an engine op that refused the probe's shapes: recorded, never the run's end
        return None, CandidateEvidence(why=f"the GDN probe could not run here: {type(exc).__name__}: {exc}"[:300], failed=True), record
    candidates = {form.describe(): len(differ)}
    if differ:
        why = f"the engine's {', '.join(differ)} part(s) from the contract's"
        return None, CandidateEvidence(candidates, why=why, details={"layer": name}), record
    return form, keeping(CandidateEvidence(candidates, details={"layer": name}), form), record


def _build_followed(kernels: str, state_dtype: torch.dtype | None) -> str:
    """``PORTABLE``, ``PORTABLE_FMA`` or ``AVX512`` where the contract follows the engine's GDN kernels on this CPU, else why
    not."""
    avx512_bf16 = torch.cpu._is_avx512_bf16_supported()  # vLLM's own test for its C++ conv (gdn_attention.py)
    if PORTABLE_BUILD in kernels:
        if avx512_bf16:
            return (f"the engine runs its C++ conv kernels on this CPU (AVX-512 BF16) with its {PORTABLE_BUILD} build, which the "
                    "contract does not follow: roll out at --isa auto (the AVX-512 build, followed) or --isa avx2")  # fmt: skip
        return PORTABLE
    if PORTABLE_FMA_BUILD in kernels and not avx512_bf16:  # what vLLM loads on an AVX-512 CPU without AVX512-BF16
        return PORTABLE_FMA
    if AVX512_BUILD in kernels and avx512_bf16:
        # an AMX CPU runs the same build; its GEMMs are libtorch's brgemm on AMX tiles there, which the contract calls too
        # (gdn_avx512_kernels.cpp), and the probe holds it to the engine's ops on that CPU
        if state_dtype != torch.float32:
            return (f"the engine's {kernels} GatedDeltaNet kernels with a {state_dtype} SSM state cache: followed with an fp32 "
                    "one; launch the engine with its default fp32 mamba_ssm_cache_dtype, or --isa avx2")  # fmt: skip
        return AVX512
    return (f"the engine loaded its {kernels} kernels with the CPU's AVX512-BF16 {'on' if avx512_bf16 else 'off'}, a pairing vLLM "
            "never loads and whose GatedDeltaNet ops the contract does not follow; rollout --isa auto, avx512 or avx2 runs one it "
            "does")  # fmt: skip


def _not_followed(dim: int, value_dim: int, state_dtype: torch.dtype | None) -> str | None:
    if dim != value_dim or dim not in HEAD_DIMS:
        return f"linear head dims {dim} (key) / {value_dim} (value): the engine's chunk kernel takes one dim of {HEAD_DIMS}"
    if state_dtype not in (torch.bfloat16, torch.float32):
        return f"the engine's SSM state is {state_dtype}, not a bf16 or fp32 cache"
    return None


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _gating_checked(Hv: int, kernels: str, gen: torch.Generator, differ: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's prefill gating against the contract's ``kernels`` on random inputs ("prefill gating" appended to
    ``differ`` where a bit parts); returns the A_log and dt_bias drawn, for the probes after it."""
    from fx_precision.contract import gdn as ours

    bf, T = torch.bfloat16, 37
    A_log, dt_bias = torch.randn(Hv, generator=gen).float(), torch.randn(Hv, generator=gen).to(bf)
    a, b = (torch.randn(T, Hv, generator=gen) * 3).to(bf), (torch.randn(T, Hv, generator=gen) * 3).to(bf)
    g_ref, beta_ref = torch.ops._C.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    g, beta = ours.gating(a, b, A_log, dt_bias, decode=False, kernels=kernels)
    if not (torch.equal(g, g_ref.reshape(T, Hv)) and torch.equal(beta, beta_ref.reshape(T, Hv))):
        differ.append("prefill gating")
    return A_log, dt_bias


def _chunk_checked(H: int, Hv: int, D: int, state_dtype: torch.dtype, kernels: str, gen: torch.Generator, differ: list[str]) -> None:
    """The engine's chunk rule on four requests in one call (pieces of 1, 33, 64 and 130 tokens, a new one and three
    with a state) against the contract's ``kernels``, request by request ("chunk rule (N tokens)" appended to ``differ``
    at the first that parts)."""
    from fx_precision.contract import gdn as ours

    bf, lens = torch.bfloat16, [1, 33, 64, 130]
    total = sum(lens)
    q, k, v = (torch.randn(1, total, h, D, generator=gen).to(bf) for h in (H, H, Hv))
    gg, bb = (-torch.rand(1, total, Hv, generator=gen) * 0.5).float(), torch.rand(1, total, Hv, generator=gen).to(bf)
    pool = (torch.randn(len(lens), Hv, D, D, generator=gen) * 0.2).to(state_dtype)
    pool[0] = 0  # a new request: the engine zeroes its slot
    start = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.arange(len(lens), dtype=torch.int32)
    out_ref, _ = torch.ops._C.chunk_gated_delta_rule_cpu(q, k, v, gg, bb, pool, True, cu, False, True, slots, EPS)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        st = start[i].float().contiguous()
        if kernels == AVX512:
            got = ours.chunk512(q[0, s:e], k[0, s:e], v[0, s:e], gg[0, s:e], bb[0, s:e], st, EPS)
        else:
            got = ours.chunk_rule(q[0, s:e], k[0, s:e], v[0, s:e], gg[0, s:e], bb[0, s:e], st, state_dtype == bf, EPS)
        if not (torch.equal(got, out_ref[0, s:e]) and torch.equal(st.to(state_dtype), pool[i])):
            differ.append(f"chunk rule ({e - s} tokens)")
            return


def _differing(H: int, Hv: int, D: int, K: int, state_dtype: torch.dtype, gen: torch.Generator, kernels: str = PORTABLE) -> list[str]:
    """The kernels of the portable code (``kernels``: ``PORTABLE``, or ``PORTABLE_FMA`` as the _C_AVX512 build compiled it)
    whose bits part from the contract's on random inputs at these sizes (empty: every bit equal)."""

    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

    from fx_precision.contract import gdn as ours

    ops = torch.ops._C
    bf = torch.bfloat16
    bf16_state = state_dtype == bf
    differ: list[str] = []

    randn = functools.partial(_randn, gen)

    A_log, dt_bias = _gating_checked(Hv, PORTABLE, gen, differ)
    _chunk_checked(H, Hv, D, state_dtype, PORTABLE, gen, differ)
    B = 3
    q, k, v = randn(1, B, H, D).to(bf), randn(1, B, H, D).to(bf), randn(1, B, Hv, D).to(bf)
    a, b = randn(B, Hv, scale=2).to(bf), randn(B, Hv).to(bf)
    pool = randn(B, Hv, D, D, scale=0.3).to(state_dtype)
    start = pool.clone()
    out_ref = ops.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, pool, torch.arange(B, dtype=torch.int32),
                                                             torch.arange(B + 1, dtype=torch.int32), True, 1.0, 20.0)  # fmt: skip
    g, beta = ours.gating(a, b, A_log, dt_bias, decode=True)
    st = start.float().contiguous()
    got = ours.decode_rule(q[0], k[0], v[0], g, beta, st, bf16_state, EPS, kernels)
    if not (torch.equal(got, out_ref.reshape(B, Hv, D)) and torch.equal(st.to(state_dtype), pool)):
        differ.append("decode rule")
    C = 2 * H * D + Hv * D
    weight = randn(C, K, scale=0.5).to(bf)
    cache = randn(2, K - 1, C).to(bf)  # vLLM's SD layout: (slots, K - 1, C), passed transposed
    x = randn(2, C).to(bf)
    mine = []
    for i in range(2):
        conv_state = cache[i].t().contiguous()
        mine.append((ours.conv_decode(x[i], conv_state, weight), conv_state))
    ref = ops.causal_conv1d_update_cpu_vec(x.clone(), cache.transpose(-1, -2), weight, None, "silu", torch.arange(2, dtype=torch.int32),
                                           None, -1)  # fmt: skip
    if not all(torch.equal(o, ref[i]) and torch.equal(s, cache[i].t()) for i, (o, s) in enumerate(mine)):
        differ.append("conv update (decode)")
    L = 45
    xs = randn(C, L).to(bf)
    states = randn(1, C, K - 1).to(bf)
    ref_out = causal_conv1d_fn_cpu(xs.clone(), weight, None, states.clone(), torch.tensor([0, L], dtype=torch.int32),
                                   torch.tensor([0], dtype=torch.int32), torch.tensor([True]), "silu")  # fmt: skip
    if not torch.equal(ours.prefill_conv(xs, states[0], weight), ref_out):
        differ.append("conv (prefill)")
    return differ


def _differing512(H: int, Hv: int, D: int, gen: torch.Generator) -> list[str]:
    """``_differing`` for the AVX-512 build: its gating (vector blocks of 32 heads and the scalar rest), chunk rule, decode
    kernel and C++ conv on packed weights (a prefill piece with and without a stored history, a decoded token) against
    the contract's (contract/gdn.py: ``*512``)."""
    from fx_precision.contract import gdn as ours

    ops = torch.ops._C
    bf = torch.bfloat16
    differ: list[str] = []

    randn = functools.partial(_randn, gen)

    A_log, dt_bias = _gating_checked(Hv, AVX512, gen, differ)
    _chunk_checked(H, Hv, D, torch.float32, AVX512, gen, differ)
    B = 3
    q, k, v = randn(1, B, H, D).to(bf), randn(1, B, H, D).to(bf), randn(1, B, Hv, D).to(bf)
    a, b = randn(B, Hv, scale=2).to(bf), randn(B, Hv).to(bf)
    pool = randn(B, Hv, D, D, scale=0.3)
    st = pool.clone()
    out_ref = ops.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, pool, torch.arange(B, dtype=torch.int32),
                                                             torch.arange(B + 1, dtype=torch.int32), True, 1.0, 20.0)  # fmt: skip
    got = ours.decode512(q[0], k[0], v[0], a, b, A_log, dt_bias, st)
    if not (torch.equal(got, out_ref.reshape(B, Hv, D)) and torch.equal(st, pool)):
        differ.append("decode rule")
    C = 2 * H * D + Hv * D
    weight = randn(C, 4, scale=0.5).to(bf)
    packed = ops.causal_conv1d_weight_pack(weight.contiguous())
    for L, stored in ((45, True), (70, False), (1, True)):
        x = randn(L, C, scale=2).to(bf).contiguous()
        history = randn(3, C).to(bf) if stored else torch.zeros(3, C, dtype=bf)
        cache = torch.zeros(2, 3, C, dtype=bf)  # vLLM's SD layout (slots, K - 1, C), passed transposed
        cache[1] = history
        slot = torch.tensor([1], dtype=torch.int32)
        if L == 1:  # a decoded token: the update kernel
            ref = ops.causal_conv1d_update_cpu(x, cache.transpose(1, 2), packed, None, True, None, slot, -1, True)
        else:
            ref = ops.causal_conv1d_fwd_cpu(x.t(), packed, None, cache.transpose(1, 2), torch.tensor([0, L], dtype=torch.int32), slot,
                                            torch.tensor([stored]), True, -1, True).t()  # fmt: skip
        if not torch.equal(ours.conv512(x, history, weight), ref.contiguous()):
            differ.append(f"conv ({'decode' if L == 1 else 'prefill'}, {L} token(s))")
            break
    return differ
