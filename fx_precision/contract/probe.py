"""Detecting the engine contract: run the engine's own ops on probe values, keep the candidate that matches.

    probe_engine(engine)                              (in the engine's process: vLLM imported there)
    ├── rotary     the model's rotary module on random bf16 q / k at random positions
    │              candidates: kernel + nearest-even | kernel + truncate | native (bf16 torch ops)
    ├── norm       the model's first fused norm on (x, residual)
    │              candidates: normalise the fp32 sum (fused-add) | the rounded sum (plain)
    ├── linears    the first layer's linears and the output projection on 2-4 rows (their weights read
    │              back through identity rows): the batched kernel | the small-batch kernel
    └── attention  the engine's attention op alone (its KV cache, block table and scheduler), causal
                   prefill of several lengths and a decode row; candidates: every AttentionArithmetic
                   (scores, exp, lane reduction, P dtype, fma, store), computed by the contract's kernel

A candidate is kept when it matches every probe element bit for bit. None or several left is
reported as such in ``evidence`` (with each candidate's mismatch count), never papered over.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from fx_precision.contract import AttentionArithmetic, EngineContract
from fx_precision.contract.ops import engine_attention, round_to, variant_codes
from fx_precision.errors import PrecisionError

PROBE_LENGTHS = (7, 45, 150, 333)
ROTARY_CANDIDATES = ("nearest-even", "truncate", "native")  # several KV blocks of 128, and tails off every 16 / 32 boundary


def _first(model: Any, suffix: str) -> Any:
    return next((m for m in model.modules() if type(m).__name__.endswith(suffix)), None)


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float() != b.float()).sum()) if a.shape == b.shape else a.numel()


# ---------------------------------------------------------------------------------------------
# rotary
# ---------------------------------------------------------------------------------------------


def probe_rotary(model: Any, gen: torch.Generator) -> tuple[str, str | None, dict[str, int]]:
    """(rotary kind, the kernel's rounding or None, mismatches per candidate)."""
    rope = _first(model, "RotaryEmbedding")
    if rope is None:
        return "none", None, {}
    if not hasattr(rope, "cos_sin_cache"):  # transformers' module (the engine's Transformers backend): the training side's code
        return "native", None, {"module": f"{type(rope).__module__}.{type(rope).__name__}: the model's own code, not probed"}
    head, rot = int(rope.head_size), int(rope.rotary_dim)
    if not rope.is_neox_style:  # GPT-J style pairs: the contract's rotary op takes neox halves
        return "unmatched", None, {"interleaved (GPT-J style): not followed": 1}
    tokens, heads = 257, 4
    positions = torch.randint(0, min(int(rope.max_position_embeddings), 4096), (tokens,), generator=gen)
    q = (torch.randn(tokens, heads * head, generator=gen) * 3).to(torch.bfloat16)
    k = (torch.randn(tokens, heads * head, generator=gen) * 3).to(torch.bfloat16)
    got_q, got_k = rope(positions, q.clone(), k.clone())
    cache = rope.cos_sin_cache.to(torch.bfloat16)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]

    def rotated(x: torch.Tensor, kind: str) -> torch.Tensor:
        xh = x.view(tokens, heads, head)
        part, rest = xh[..., :rot], xh[..., rot:]
        if kind == "native":  # transformers' apply_rotary_pos_emb in bf16: every op rounds
            half = rot // 2
            turned = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
            out = part * cos + turned * sin
        else:
            from fx_precision.contract.ops import ROUNDING_CODE, _rotate

            out = round_to(_rotate(part, cos, sin), torch.bfloat16, ROUNDING_CODE[kind])
        return torch.cat((out, rest), dim=-1).reshape(tokens, -1)

    counts = {kind: _mismatches(rotated(q, kind), got_q) + _mismatches(rotated(k, kind), got_k) for kind in ROTARY_CANDIDATES}
    best = min(counts, key=lambda c: counts[c])
    if counts[best]:
        return "unmatched", None, counts
    return ("native", None, counts) if best == "native" else ("kernel", best, counts)


# ---------------------------------------------------------------------------------------------
# norm
# ---------------------------------------------------------------------------------------------


def probe_norm(model: Any, gen: torch.Generator) -> tuple[str, dict[str, int]]:
    """(how the engine's norm after a residual add sees the sum, mismatches per candidate): ``fused-add``
    normalises the fp32 sum of the two bf16 operands, ``plain`` the sum rounded to bf16. Each is tried with
    the weight as Llama applies it (after the rounding) and as Gemma does ((1 + w) in fp32, then one rounding)."""
    norm = next((m for n, m in model.named_modules() if n.endswith("post_attention_layernorm")), None)
    if norm is None:
        return "unprobed", {}
    if type(norm).__module__.startswith("transformers."):  # the engine's Transformers backend runs the model's own norm
        return "plain", {}
    width = int(norm.weight.shape[0])
    x = (torch.randn(64, width, generator=gen) * 2).to(torch.bfloat16)
    residual = (torch.randn(64, width, generator=gen) * 2).to(torch.bfloat16)
    import inspect

    takes = inspect.signature(getattr(norm, "forward_native", norm.forward)).parameters
    if len(takes) < 2:  # a norm without a residual input: the add is the model's own, rounded
        return "plain", {f"{type(norm).__name__} takes no residual": 0}
    out, _ = norm(x.clone(), residual.clone())
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    weight = norm.weight.detach()

    def normed(h: torch.Tensor, style: str) -> torch.Tensor:
        scaled = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if style == "gemma":
            return (scaled * (1.0 + weight.float())).to(torch.bfloat16)
        return scaled.to(torch.bfloat16) * weight.to(torch.bfloat16)

    total = x.float() + residual.float()
    sums = {"fused-add": total, "plain": total.to(torch.bfloat16).float()}
    counts = {f"{kind} ({style} weight)": _mismatches(normed(h, style), out) for kind, h in sums.items() for style in ("llama", "gemma")}
    best = min(counts, key=lambda c: counts[c])
    return (best.split(" ")[0] if counts[best] == 0 else "unmatched"), counts


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def candidates() -> list[AttentionArithmetic]:
    out = []
    for scores, exp, reduce, fma, store in itertools.product(("amx", "vec"), ("libm", "fast512"), ("avx512", "avx2"), (False, True),
                                                             ("nearest-even", "truncate")):  # fmt: skip
        if scores == "amx" and (fma or store == "truncate" or reduce == "avx2"):
            continue  # AMX: exact bf16 products (fma changes nothing), an AVX-512 build, rounding stores
        out.append(AttentionArithmetic(scores, exp, reduce, scores == "amx", fma, store))
    return out


def engine_attention_op(isa: str, block_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        q_offset: int, split_kv: bool) -> torch.Tensor:  # fmt: skip
    """vLLM's CPU attention on one sequence: k / v [S, KVH, D] into a paged cache, q [T, H, D] its last T positions."""
    from vllm import _custom_ops as ops

    if isa == "amx" and not torch._C._cpu._init_amx():  # the engine's AMX kernel, called from this thread
        raise PrecisionError("this process has no permission to use AMX tiles (arch_prctl XCOMP_PERM); the attention probe needs it")
    seq, kv_heads, dim = k.shape
    blocks = (seq + block_size - 1) // block_size
    cache = torch.zeros(blocks, kv_heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, kv_heads, block_size * 2, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(seq, dtype=torch.int64), isa)
    start = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    lens = torch.tensor([seq], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=q.shape[1], num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens, dtype=torch.bfloat16,
        query_start_loc=start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=split_kv,
    )  # fmt: skip
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=start, seq_lens=lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=torch.arange(blocks, dtype=torch.int32)[None],
        softcap=0.0, scheduler_metadata=meta, s_aux=None,
    )  # fmt: skip
    return out


def probe_attention(engine: Any, gen: torch.Generator) -> tuple[AttentionArithmetic | None, dict[str, int]]:
    config = engine.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", heads))
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    isa, block = engine.info["attention_isa"], int(engine.info["block_size"])
    scale = dim**-0.5
    cases = []
    for n in PROBE_LENGTHS:
        k = (torch.randn(n, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(torch.bfloat16)
        q = (torch.randn(n, heads, dim, generator=gen) * 2).to(torch.bfloat16)
        cases.append((q, k, v, 0))  # prefill
        cases.append((q[-1:].clone(), k, v, n - 1))  # a decode row: one query at the last position
    got = [engine_attention_op(isa, block, q, k, v, scale, off, engine.info["split_kv"]) for q, k, v, off in cases]
    counts: dict[str, int] = {}
    kept = []
    for arith in candidates():
        wrong = 0
        for (q, k, v, off), want in zip(cases, got, strict=True):
            mine = engine_attention(
                q[None], k[None], v[None], torch.tensor([k.shape[0]]), None, scale, True, -1, off, variant_codes(arith)
            )[0]
            wrong += _mismatches(mine, want)
        counts[arith.describe()] = wrong
        if wrong == 0:
            kept.append(arith)
    if len(kept) > 1:  # indistinguishable on these probes: the first in candidate order, recorded as ambiguous
        counts["ambiguous"] = len(kept)
    return (kept[0] if kept else None), counts


# ---------------------------------------------------------------------------------------------
# linears
# ---------------------------------------------------------------------------------------------


def _linear_calls(model: Any) -> dict[str, tuple[Any, int]]:
    """The first decoder layer's linears and the output projection: name -> (call on [M, K] rows, K)."""
    calls: dict[str, tuple[Any, int]] = {}
    for name, module in model.named_modules():
        size = getattr(module, "input_size", None)
        if ".layers.0." in name and isinstance(size, int) and hasattr(module, "quant_method"):
            calls[name] = ((lambda x, m=module: m(x)[0]), size)
    head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if head is not None and processor is not None:
        calls["lm_head"] = ((lambda x: processor(head, x)), int(getattr(head, "embedding_dim", 0) or head.weight.shape[-1]))
    return calls


def checkpoint_weights(directory: str) -> Any:
    """name -> (weight, bias) of a vLLM linear from the checkpoint it loaded (fused qkv / gate_up rebuilt from
    their parts, or read as stored where the checkpoint holds them fused)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(file)))

    def fused(prefix: str, parts: tuple[str, ...], kind: str) -> torch.Tensor | None:
        found = [tensors.get(f"{prefix}.{p}.{kind}") for p in parts]
        return torch.cat(found) if all(t is not None for t in found) else None

    def lookup(name: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if name == "lm_head":
            weight = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
            return (weight, None) if weight is not None else None
        prefix, leaf = name.rsplit(".", 1)
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf)
        if parts is not None and (weight := fused(prefix, parts, "weight")) is not None:
            return weight, fused(prefix, parts, "bias")
        weight = tensors.get(f"{name}.weight")  # also a checkpoint that stores the fused weight (Phi-3's qkv_proj, gate_up_proj)
        return (weight, tensors.get(f"{name}.bias")) if weight is not None else None

    return lookup


def _parts(name: str, shape: tuple[int, int], config: Any) -> list[tuple[int, int]]:
    """The shapes of the training side's linears an engine's fused one stands for (every output column of
    a linear is its own dot product, so each part is computed alike): qkv -> q, k, v; gate_up -> gate, up."""
    n, k = shape
    if name.endswith("qkv_proj"):
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", heads))
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return [(heads * dim, k), (kv * dim, k)]
    if name.endswith("gate_up_proj"):
        return [(n // 2, k)]
    return []


def probe_linears(
    model: Any, gen: torch.Generator, weights: Any, config: Any = None, trials: int = 60
) -> tuple[int, tuple[tuple[int, int], ...], dict[str, Any]]:
    """(rows at or below which the engine's linears switch kernels, the weight shapes that do, evidence)."""
    from fx_precision.contract.kernels import engine_kernels

    if not engine_kernels().cpu_has_avx512_bf16():
        return 0, (), {"skipped": "no AVX-512 BF16 on this CPU: the engine's small-batch kernel is not built for it"}
    evidence: dict[str, Any] = {}
    shapes = []
    for name, (call, k) in _linear_calls(model).items():
        found = weights(name)
        if found is None:
            evidence[name] = "no weight of that name in the checkpoint: not probed"
            continue
        weight, bias = found[0].to(torch.bfloat16).contiguous(), found[1]
        wrong = {"small-batch kernel": 0, "batched kernel": 0}
        kernel_takes = weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0
        for trial in range(trials * 6):  # on until one kernel is told apart, or 6x the trials
            if trial >= trials and (wrong["batched kernel"] or wrong["small-batch kernel"]):
                break
            x = (torch.randn(4, k, generator=gen) * 3).to(torch.bfloat16)
            for m in (2, 3, 4):
                got = call(x[:m].clone())
                big = torch.nn.functional.linear(x[:m], weight, bias)
                wrong["batched kernel"] += int((big != got).any(-1).sum())
                if not kernel_takes:  # e.g. a router with N < 16: the engine's fp32 fallback, which no candidate here is
                    wrong["small-batch kernel"] += m
                    continue
                small = engine_kernels().small_batch_linear(x[:m], weight, bias)
                wrong["small-batch kernel"] += int((small != got).any(-1).sum())
        evidence[f"{name} {tuple(weight.shape)}"] = wrong
        if wrong["small-batch kernel"] and wrong["batched kernel"]:
            evidence.setdefault("unmatched", []).append(name)  # neither kernel the contract knows: its rows will differ
        if wrong["small-batch kernel"] == 0:  # matched every row (both kernels agreeing on all of them is recorded as such)
            shapes.append(tuple(weight.shape))
            shapes.extend(_parts(name, tuple(weight.shape), config) if config is not None else [])
    return (4 if shapes else 0), tuple(sorted(set(shapes))), evidence


def probe_engine(engine: Any, checkpoint: str, norm_calls: dict[str, int] | None = None) -> EngineContract:
    """The contract of ``engine`` on this machine (see the module docstring). ``norm_calls`` counts how the
    engine's model called its post-attention norms while it generated: a model that adds the residual itself
    and calls the norm on the rounded sum (Granite: ``residual + h * multiplier``) is ``plain`` whatever the
    norm class could fuse."""
    gen = torch.Generator().manual_seed(20261201)
    model = engine.model
    rotary, rotary_rounding, rotary_counts = probe_rotary(model, gen)
    norm, norm_counts = probe_norm(model, gen)
    if norm_calls and norm_calls.get("without", 0) and not norm_calls.get("with_residual", 0):
        norm, norm_counts = "plain", {**norm_counts, "called without a residual while generating": norm_calls["without"]}
    attention, attention_counts = probe_attention(engine, gen)
    small_rows, small_shapes, linear_counts = probe_linears(model, gen, checkpoint_weights(checkpoint), engine.config)
    evidence = {
        "linears": linear_counts,
        "rotary": rotary_counts,
        "norm": norm_counts,
        "attention": attention_counts,
        "attention_isa": engine.info["attention_isa"],
        "kernels": engine.info["kernels"],
        "matched": {
            "rotary": rotary != "unmatched",
            "norm": norm != "unmatched",
            "attention": attention is not None,
            "linears": not linear_counts.get("unmatched"),
        },
    }
    rounding = rotary_rounding or (attention.store if attention else "nearest-even")
    return EngineContract(
        engine="vllm",
        version=engine.info["version"],
        rounding=rounding,
        rotary="native" if rotary in ("native", "none") else "kernel",
        norm="plain" if norm == "plain" else "fused-add",
        attention=attention or AttentionArithmetic(),
        small_batch_rows=small_rows,
        small_batch_shapes=small_shapes,
        evidence=evidence,
    )
