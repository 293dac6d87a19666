"""The probes' handles into vLLM: its rotary module, its fused norm, its attention op, its linears and its weights.

Everything vLLM-specific a probe needs, handed to the engine-agnostic matching (``contract/probing.py``)::

    rotary_handles(model)       the rotary module (cos_sin_cache, head size, neox halves)
    norm_handles(model)         the first post-attention norm, called with a residual (fused add + norm)
    engine_attention_batch      vLLM's CPU attention op on a batch of requests in one call (its paged cache,
                                block table and scheduler), as a scheduler step runs it
    linear_calls(model, ...)    the first layer's linears (``quant_method`` modules) and the output projection
                                (through ``logits_processor``), each with the checkpoint's weight
    checkpoint_weights(dir)     a vLLM linear's weight from the checkpoint it loaded (fused qkv / gate_up
                                rebuilt from their parts, or read as stored where the checkpoint holds them fused)
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path
from typing import Any

import torch

from fx_precision.errors import PrecisionError


def first_module(model: Any, suffix: str) -> Any:
    return next((m for m in model.modules() if type(m).__name__.endswith(suffix)), None)


def engine_attention_batch(isa: str, block_size: int, requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float,
                           split_kv: bool) -> list[torch.Tensor]:  # fmt: skip
    """vLLM's CPU attention on a batch of requests in one call, as a scheduler step runs them: each (q [T, H, D], k / v
    [S, KVH, D]) with q the last T positions of its S; every request's keys in its own blocks of one paged cache."""
    from vllm import _custom_ops as ops

    if isa == "amx" and not torch._C._cpu._init_amx():  # the engine's AMX kernel, called from this thread
        raise PrecisionError("this process has no permission to use AMX tiles (arch_prctl XCOMP_PERM); the attention probe needs it")
    _, heads, dim = requests[0][0].shape
    kv_heads = requests[0][1].shape[1]
    per = [(int(k.shape[0]) + block_size - 1) // block_size for _, k, _ in requests]
    blocks = sum(per)
    cache = torch.zeros(blocks, kv_heads, block_size, 2 * dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, kv_heads, block_size * 2, dim).chunk(2, dim=2)
    table = torch.zeros(len(requests), max(per), dtype=torch.int32)
    first = 0
    for i, ((_, k, v), n) in enumerate(zip(requests, per, strict=True)):
        table[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        slots = first * block_size + torch.arange(k.shape[0], dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        first += n
    lengths = [int(q.shape[0]) for q, _, _ in requests]
    start = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    lens = torch.tensor([int(k.shape[0]) for _, k, _ in requests], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(requests), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=lens, dtype=torch.bfloat16,
        query_start_loc=start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=split_kv,
    )  # fmt: skip
    query = torch.cat([q for q, _, _ in requests])
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=start, seq_lens=lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None,
    )  # fmt: skip
    return list(out.split(lengths))


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
        found = [t for p in parts if (t := tensors.get(f"{prefix}.{p}.{kind}")) is not None]
        return torch.cat(found) if len(found) == len(parts) else None

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


def linear_calls(model: Any, directory: str) -> dict[str, tuple[Any, torch.Tensor, torch.Tensor | None, bool]]:
    """name -> (the engine's call on [M, K] bf16 rows, its bf16 weight, its bias, whether it is the output projection)."""
    weights = checkpoint_weights(directory)
    out = {}
    for name, (call, _k) in _linear_calls(model).items():
        found = weights(name)
        if found is not None:
            out[name] = (call, found[0].to(torch.bfloat16).contiguous(), found[1], name == "lm_head")
    return out


def fused_norm(model: Any) -> tuple[Any, str]:
    """The first post-attention norm and how it can be probed: "fused" (it takes the residual: vLLM's fused add +
    norm), "model" (the engine's Transformers backend runs the model's own norm), "no residual", "none"."""
    norm = next((m for n, m in model.named_modules() if n.endswith("post_attention_layernorm")), None)
    if norm is None:
        return None, "none"
    if type(norm).__module__.startswith("transformers."):
        return norm, "model"
    takes = inspect.signature(getattr(norm, "forward_native", norm.forward)).parameters
    return norm, ("fused" if len(takes) >= 2 else "no residual")
