"""Detecting the engine contract: run the engine's own ops on probe values, keep the candidate that matches.

    probe_engine(engine)                              (in the engine's process: vLLM imported there)
    ├── rotary     the model's rotary module on random bf16 q / k at random positions
    │              candidates: kernel + nearest-even | kernel + truncate | native (bf16 torch ops)
    ├── norm       the model's first fused norm on (x, residual)
    │              candidates: normalise the fp32 sum (fused-add) | the rounded sum (plain)
    ├── linears    the first layer's linears at every step size of the run, the output projection at every
    │              logits call's size, on inputs that make summation orders visible: the order of the family
    │              (contract/linear_order.py) that gives every output's bits
    └── attention  the engine's attention op alone (its KV cache, block table and scheduler), causal
                   prefill of several lengths and a decode row; candidates: every AttentionArithmetic
                   (scores, exp, lane reduction, P dtype, fma, store), computed by the contract's kernel

A candidate is kept when it matches every probe element bit for bit. None or several left is
reported as such in ``evidence`` (with each candidate's mismatch count), never papered over.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fx_precision.contract import AttentionArithmetic, EngineContract
from fx_precision.contract.linear_order import LinearCall, LinearKernel, LinearOrder, LinearOrders, candidate_orders
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
    return engine_attention_batch(isa, block_size, [(q, k, v)], scale, split_kv)[0]


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


def step_shapes(sequences: list[Any], steps: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, int], ...]]:
    """Each engine step's attention call as the requests it held: (query rows, keys) per request, in the step's order
    (rows mapped to their sequences by contract.batch_rows.steps_of); distinct calls only."""
    from fx_precision.contract.batch_rows import steps_of

    owner: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (step, row index in it) <- (sequence, position)
    for s, found in enumerate(steps_of(sequences, steps)):
        for position, step in enumerate(found):
            if step is not None:
                owner.setdefault((step, s), []).append((s, position))
    shapes: dict[tuple[tuple[int, int], ...], None] = {}
    for i, _rows in enumerate(steps):
        requests = sorted((positions[0][1], s, len(positions), positions[-1][1] + 1) for (step, s), positions in owner.items() if step == i)
        shape = tuple((q, kv) for _, _, q, kv in sorted(requests, key=lambda r: r[1]))
        if shape:
            shapes.setdefault(shape, None)
    return list(shapes)


def probe_attention(engine: Any, gen: torch.Generator) -> tuple[AttentionArithmetic | None, dict[str, Any]]:
    """The attention arithmetic: the candidates that give every prefill probe's bits (several lengths: KV blocks of
    128, tails off 16 / 32), narrowed by decode rows (one query at the last position) where some candidates give
    theirs too. Where no candidate gives a decode row's bits (split-KV: keys split across threads, merged), the
    prefill's arithmetic is kept and ``decode`` says the engine's decode is not followed."""
    config = engine.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", heads))
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    isa, block = engine.info["attention_isa"], int(engine.info["block_size"])
    scale = dim**-0.5
    prefill, decode = [], []
    for n in PROBE_LENGTHS:
        k = (torch.randn(n, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(torch.bfloat16)
        q = (torch.randn(n, heads, dim, generator=gen) * 2).to(torch.bfloat16)
        prefill.append((q, k, v, 0))
        decode.append((q[-1:].clone(), k, v, n - 1))

    def wrong(arith: AttentionArithmetic, cases: list[tuple[Any, ...]], got: list[torch.Tensor]) -> int:
        total = 0
        for (q, k, v, off), want in zip(cases, got, strict=True):
            mine = engine_attention(
                q[None], k[None], v[None], torch.tensor([k.shape[0]]), None, scale, True, -1, off, variant_codes(arith)
            )[0]
            total += _mismatches(mine, want)
        return total

    split = engine.info["split_kv"]
    got_prefill = [engine_attention_op(isa, block, q, k, v, scale, off, split) for q, k, v, off in prefill]
    got_decode = [engine_attention_op(isa, block, q, k, v, scale, off, split) for q, k, v, off in decode]
    counts: dict[str, Any] = {}
    kept = []
    for arith in candidates():
        counts[arith.describe()] = wrong(arith, prefill, got_prefill)
        if counts[arith.describe()] == 0:
            kept.append(arith)
    decoding = [a for a in kept if wrong(a, decode, got_decode) == 0]
    if kept and not decoding:
        counts["decode"] = "no candidate gives the engine's decode rows (split-KV on several threads?): not followed"
    kept = decoding or kept
    if len(kept) > 1:  # indistinguishable on these probes: the first in candidate order, recorded as ambiguous
        counts["ambiguous"] = len(kept)
    return (kept[0] if kept else None), counts


MAX_RUN_SHAPES = 64  # attention calls of the run checked whole (decode steps are cheap; long prefills are few)


def check_attention_at_run(engine: Any, arith: AttentionArithmetic, shapes: list[tuple[tuple[int, int], ...]],
                           gen: torch.Generator) -> dict[str, Any]:  # fmt: skip
    """The kept arithmetic against the engine's attention at the calls the run made (every request of a step in one
    call, with the engine's threads, split-KV setting and scheduler): where the engine's order depends on the batch,
    the lengths or its threads (KV tiles and their rescaling, split-KV), this is where it shows. Mismatching rows
    per call; ``unmatched`` lists the calls that part."""
    config = engine.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", heads))
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    isa, block = engine.info["attention_isa"], int(engine.info["block_size"])
    scale = dim**-0.5
    out: dict[str, Any] = {"calls": len(shapes), "checked": min(len(shapes), MAX_RUN_SHAPES)}
    unmatched = []
    for shape in shapes[:MAX_RUN_SHAPES]:
        requests = []
        for q_rows, keys in shape:
            k = (torch.randn(keys, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
            v = torch.randn(keys, kv_heads, dim, generator=gen).to(torch.bfloat16)
            q = (torch.randn(q_rows, heads, dim, generator=gen) * 2).to(torch.bfloat16)
            requests.append((q, k, v))
        got = engine_attention_batch(isa, block, requests, scale, engine.info["split_kv"])
        wrong = 0
        for (q, k, v), want in zip(requests, got, strict=True):
            mine = engine_attention(
                q[None], k[None], v[None], torch.tensor([k.shape[0]]), None, scale, True, -1, k.shape[0] - q.shape[0], variant_codes(arith)
            )[0]
            wrong += int((mine != want).any(-1).any(-1).sum())
        if wrong:
            unmatched.append(f"{len(shape)} request(s) {list(shape)[:3]}{'...' if len(shape) > 3 else ''}: {wrong} row(s) differ")
    if unmatched:
        out["unmatched"] = unmatched
    return out


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


PROBE_OUTPUTS = 256  # targeted outputs a linear call is read on (more trials where a call holds fewer rows)
MAX_TRIALS = 256


def _cancelling_pair(w: torch.Tensor, later: int) -> tuple[int, int] | None:
    """(i, j): an element of the first K chunk and one of chunk ``later`` whose weights have one magnitude (bf16),
    so x_i * w_i and x_j * w_j cancel exactly with x_j = -x_i * sign(w_i w_j)."""
    k = w.shape[0]
    first, last = w[: min(32, k)].abs(), w[later * 32 : min(k, later * 32 + 32)].abs()
    hits = ((first[:, None] == last[None, :]) & (first[:, None] > 0)).nonzero()
    if hits.numel() == 0:
        return None
    i, j = hits[0].tolist()
    return int(i), int(later * 32 + j)


def _targeted_rows(weight: torch.Tensor, rows: int, trial: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe inputs that tell summation orders apart. Row m aims at output n_m: small random products, plus one
    huge product in K's first chunk that one in a random later chunk cancels exactly, so every chunk folded while
    the huge one is in the sum rounds coarsely and a block or part summed from 0 does not: where an order starts
    its blocks and parts shows in the output's bits. Every third trial: products of one sign over half of K and
    the other over the rest (partial sums that grow and cancel). (x, n_m)."""
    n, k = weight.shape
    chunks = (k + 31) // 32
    x = torch.randn(rows, k, generator=gen)
    targets = torch.empty(rows, dtype=torch.int64)
    column = int(torch.randint(0, n, (1,), generator=gen))
    cancel = trial % 3 != 2 and chunks > 1
    for m in range(rows):
        pair = None
        for _ in range(64 if cancel else 1):
            column = (column + 7919) % n
            later = int(torch.randint(1, chunks, (1,), generator=gen)) if cancel else 0
            pair = _cancelling_pair(weight[column].float(), later) if cancel else None
            if pair is not None or not cancel:
                break
        targets[m] = column
        w = weight[column].float()
        if pair is None:
            pattern = torch.ones(k)
            pattern[k // 2 :] = -1
            x[m] = w.sign() * pattern * (1 + torch.rand(k, generator=gen))
            continue
        i, j = pair
        scale = float((x[m].abs().mean() * w.abs().mean()).clamp_min(1e-30)) * k**0.5 * 2.0**20
        big = torch.tensor(scale / abs(float(w[i]))).to(torch.bfloat16).float()
        x[m, i] = big * (1 if w[i] > 0 else -1)
        x[m, j] = -big * (1 if w[j] > 0 else -1)
    return x.to(torch.bfloat16), targets


def read_linear_order(
    call: Any, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, threads: int, gen: torch.Generator
) -> tuple[LinearOrder | None, dict[str, Any]]:
    """The order the engine's linear ``call`` sums in when it holds ``rows`` rows (contract/linear_order.py).
    Trials of targeted inputs gather ``PROBE_OUTPUTS`` probed outputs; every candidate (the orders of the family,
    the small-batch kernel) is computed for those outputs and kept when it gives all their bits; what is left is
    then run whole (every output of the last trial) before one is returned. Orders that still agree are recorded."""
    from fx_precision.contract.kernels import engine_kernels

    kernels = engine_kernels()
    n, k = weight.shape
    trials = max(3, min(MAX_TRIALS, -(-PROBE_OUTPUTS // rows)))
    xs, dots, wants, cols = [], [], [], []
    last: tuple[torch.Tensor, torch.Tensor] | None = None
    for trial in range(trials):
        x, targets = _targeted_rows(weight, rows, trial, gen)
        got = call(x.clone())
        if tuple(got.shape) != (rows, n) or got.dtype != torch.bfloat16:
            return None, {"unmatched": f"the engine's call returned {tuple(got.shape)} {got.dtype} for {rows} rows of {k}: not a bf16 GEMM"}
        dots.append(kernels.chunk_dots(x, weight[targets]))
        wants.append(got[torch.arange(rows), targets])
        xs.append(x)
        cols.append(targets)
        last = (x, got)
    all_x, all_cols, all_dots, want = torch.cat(xs), torch.cat(cols), torch.cat(dots), torch.cat(wants)
    picked_bias = bias.float()[all_cols] if bias is not None else None
    found = [o for o in candidate_orders(k, threads) if torch.equal(kernels.order_fold(all_dots, picked_bias, o.struct()), want)]
    if k % 2 == 0 and n % 16 == 0 and kernels.cpu_has_avx512_bf16():
        if torch.equal(kernels.pairs_fold(all_x, weight[all_cols], picked_bias), want):
            found.insert(0, LinearOrder(LinearKernel.PAIRS, (), (), bias_first=True))
    evidence: dict[str, Any] = {"rows": rows, "probed_outputs": int(want.numel()), "candidates_left": len(found)}
    if not found or last is None:
        return None, {**evidence, "unmatched": "no order of the family gives the engine's bits"}
    x, got = last
    with _all_threads():
        whole = [o for o in found[:2] if torch.equal(kernels.linear(x, weight, bias, o.struct()), got)]
    if not whole:
        return None, {**evidence, "unmatched": "the orders the probed outputs kept differ from the engine on other outputs"}
    if len(whole) > 1:
        evidence["ambiguous"] = [o.describe() for o in whole]
    evidence["order"] = whole[0].describe()
    return whole[0], evidence


@contextlib.contextmanager
def _all_threads() -> Iterator[None]:
    """The contract's own kernels on every core for a while (their results do not depend on it), then the engine's
    thread count back before the engine runs again."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def linear_weights(model: Any, weights: Any) -> dict[str, tuple[Any, torch.Tensor, torch.Tensor | None]]:
    """The engine's first-layer linears and its output projection: name -> (call on [M, K] rows, bf16 weight, bias)."""
    out = {}
    for name, (call, _k) in _linear_calls(model).items():
        found = weights(name)
        if found is not None:
            out[name] = (call, found[0].to(torch.bfloat16).contiguous(), found[1])
    return out


def probe_linears(
    model: Any, weights: Any, body_rows: set[int], logits_rows: set[int], threads: int, gen: torch.Generator
) -> tuple[LinearOrders, dict[str, Any]]:
    """The order of every linear call the run made: each first-layer linear at every step size of the run, the
    output projection at every logits call's size (the other layers have the same shapes and the same calls)."""
    from fx_precision.contract.kernels import engine_kernels

    if not engine_kernels().cpu_has_amx():
        return LinearOrders(threads), {"unmatched": ["this CPU has no AMX: the engine's GEMM orders here are not in the contract's family"]}
    calls: list[LinearCall] = []
    evidence: dict[str, Any] = {}
    unmatched: list[str] = []
    read: dict[tuple[int, int, int], LinearOrder | None] = {}
    for name, (call, weight, bias) in linear_weights(model, weights).items():
        n, k = weight.shape
        for rows in sorted(logits_rows if name == "lm_head" else body_rows):
            key = (n, k, rows)
            if key not in read:
                order, found = read_linear_order(call, weight, bias, rows, threads, gen)
                read[key] = order
                evidence[f"{name} {n}x{k} at {rows} rows"] = found
                if order is None:
                    unmatched.append(f"{name} at {rows} rows")
                else:
                    calls.append(LinearCall(n, k, rows, order))
    if unmatched:
        evidence["unmatched"] = unmatched
    return LinearOrders(threads, tuple(calls)), evidence


def _attention_followed(attention: AttentionArithmetic | None, counts: dict[str, Any]) -> bool:
    """Whether the kept arithmetic gives the engine's attention: the run's own calls decide where they were checked
    (a lone probe's decode row may split its keys across threads where the run's batched steps do not)."""
    if attention is None:
        return False
    at_run = counts.get("at the run's calls")
    if isinstance(at_run, dict):
        return not at_run.get("unmatched")
    return "decode" not in counts


def probe_engine(engine: Any, checkpoint: str, norm_calls: dict[str, int] | None = None, body_rows: set[int] | None = None,
                 logits_rows: set[int] | None = None, sequences: list[Any] | None = None,
                 steps: list[list[tuple[int, int]]] | None = None) -> EngineContract:  # fmt: skip
    """The contract of ``engine`` on this machine (see the module docstring). ``norm_calls`` counts how the
    engine's model called its post-attention norms while it generated: a model that adds the residual itself
    and calls the norm on the rounded sum (Granite: ``residual + h * multiplier``) is ``plain`` whatever the
    norm class could fuse. ``body_rows`` / ``logits_rows``: the rows of every forward step and logits call the
    run made (each linear's summation order is read at each); ``sequences`` and ``steps``: the run's, whose
    attention calls are checked against the kept arithmetic."""
    gen = torch.Generator().manual_seed(20261201)
    model = engine.model
    rotary, rotary_rounding, rotary_counts = probe_rotary(model, gen)
    norm, norm_counts = probe_norm(model, gen)
    if norm_calls and norm_calls.get("without", 0) and not norm_calls.get("with_residual", 0):
        norm, norm_counts = "plain", {**norm_counts, "called without a residual while generating": norm_calls["without"]}
    attention, attention_counts = probe_attention(engine, gen)
    if attention is not None and sequences is not None and steps:
        at_run = check_attention_at_run(engine, attention, step_shapes(sequences, steps), gen)
        attention_counts = {**attention_counts, "at the run's calls": at_run}
    threads = int(engine.info["threads"])
    linears, linear_counts = probe_linears(model, checkpoint_weights(checkpoint), body_rows or set(), logits_rows or set(), threads, gen)
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
            "attention": _attention_followed(attention, attention_counts),
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
        linears=linears,
        evidence=evidence,
    )
