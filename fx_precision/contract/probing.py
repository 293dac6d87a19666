"""Reading an engine's op classes off its ops: run the engine's op on probe values, keep the candidate that matches.

Engine-agnostic: an engine adapter (``fx_precision.engines``) hands in calls into its engine's ops, and these
functions hold every candidate of an op class against them, bit for bit::

    match_rotary(apply, cos_sin, ...)     the engine's rotary on random bf16 q / k at random positions
                                          candidates: kernel + nearest-even | kernel + truncate | native
    match_norm(apply, weight, eps, ...)   the engine's first fused norm on (x, residual)
                                          candidates: the fp32 sum (fused-add) | the rounded sum (plain), each with
                                          the weight as Llama applies it and as Gemma does
    match_attention(run, ...)             the engine's attention alone at several prefill lengths, narrowed by decode
                                          rows; candidates: every AttentionArithmetic, by the contract's kernel
    check_attention_calls(run, ...)       the kept arithmetic at every attention call the run made
    read_linear_order(call, ...)          one linear call's summation order (contract/linear_order.py)
    read_linear_calls(calls, ...)         every linear call the run made
    match_logprobs(generation)            the log-probs the engine returned for its sampled tokens, against the
                                          logits its sampler drew from; candidates: raw | processed (at T)

Each returns what it kept (None where no candidate matched) and its evidence (``contract/evidence.py``): every
candidate's mismatch count, and ``kept``, the one the contract takes (``EngineContract.check_evidence`` holds the
contract to it), or ``why`` none was.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from fx_precision.contract import AttentionArithmetic, RotaryOp
from fx_precision.contract.attention_tiles import KvTiling, tiles_tensor
from fx_precision.contract.batch_rows import steps_of
from fx_precision.contract.evidence import (
    AttentionEvidence,
    CandidateEvidence,
    LinearCallEvidence,
    LinearEvidence,
    LogprobEvidence,
    RunCallsChecked,
    keeping,
    linear_call_key,
    value_record,
)
from fx_precision.contract.linear_order import GEMVS, LinearCall, LinearKernel, LinearOrder, LinearOrders, candidate_orders
from fx_precision.contract.ops import engine_attention, rotate, round_to
from fx_precision.contract.vocabulary import LogprobForm, NormForm, RotaryForm, Rounding

if TYPE_CHECKING:
    from fx_precision.dump import Sequence as TokenSequence
    from fx_precision.engines.adapter import Generation  # what an engine adapter generated (the probes run engine-side)

PROBE_LENGTHS = (7, 45, 150, 333)  # several KV blocks of 128, and tails off every 16 / 32 boundary
SEPARATING_LENGTHS = (640, 1031)  # the attention probe's further rounds while two arithmetics give every row so far
SEPARATING_ROUNDS = 4


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float() != b.float()).sum()) if a.shape == b.shape else a.numel()


# ---------------------------------------------------------------------------------------------
# rotary
# ---------------------------------------------------------------------------------------------

RotaryApply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def match_rotary(
    apply: RotaryApply, cos_sin: torch.Tensor, head: int, rotary_dim: int, max_positions: int, gen: torch.Generator
) -> tuple[RotaryOp | None, CandidateEvidence]:
    """The engine's rotary (``apply(positions, q, k) -> (q, k)`` on [tokens, heads * head] bf16, neox halves; its
    bf16 cos | sin table ``cos_sin`` [positions, rotary_dim]) held against every candidate."""
    tokens, heads = 257, 4
    positions = torch.randint(0, min(max_positions, 4096), (tokens,), generator=gen)
    q = (torch.randn(tokens, heads * head, generator=gen) * 3).to(torch.bfloat16)
    k = (torch.randn(tokens, heads * head, generator=gen) * 3).to(torch.bfloat16)
    got_q, got_k = apply(positions, q.clone(), k.clone())
    cos, sin = cos_sin.to(torch.bfloat16).index_select(0, positions).chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    candidates = {"kernel, nearest-even store": RotaryOp(RotaryForm.KERNEL, Rounding.NEAREST_EVEN),
                  "kernel, truncate store": RotaryOp(RotaryForm.KERNEL, Rounding.TRUNCATE),
                  "native": RotaryOp(RotaryForm.NATIVE, None)}  # fmt: skip

    def rotated(x: torch.Tensor, op: RotaryOp) -> torch.Tensor:
        xh = x.view(tokens, heads, head)
        part, rest = xh[..., :rotary_dim], xh[..., rotary_dim:]
        if op.form == RotaryForm.NATIVE:  # transformers' apply_rotary_pos_emb in bf16: every op rounds
            half = rotary_dim // 2
            out = part * cos + torch.cat((-part[..., half:], part[..., :half]), dim=-1) * sin
        else:
            out = round_to(rotate(part, cos, sin), torch.bfloat16, op.rounding.code)  # type: ignore[union-attr]
        return torch.cat((out, rest), dim=-1).reshape(tokens, -1)

    counts = {name: mismatches(rotated(q, op), got_q) + mismatches(rotated(k, op), got_k) for name, op in candidates.items()}
    best = min(counts, key=lambda c: counts[c])
    if counts[best]:
        return None, CandidateEvidence(counts, why="no candidate gives the engine's rotary bits")
    return candidates[best], keeping(CandidateEvidence(counts), candidates[best])


# ---------------------------------------------------------------------------------------------
# norm
# ---------------------------------------------------------------------------------------------


def match_norm(
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight: torch.Tensor, eps: float, gen: torch.Generator
) -> tuple[NormForm | None, CandidateEvidence]:
    """The engine's norm after a residual add (``apply(x, residual) -> normed x``, bf16 [rows, width]) held against
    the fp32 sum (fused-add) and the rounded sum (plain), each with the weight as Llama applies it (after the
    rounding) and as Gemma does ((1 + w) in fp32, then one rounding)."""
    width = int(weight.shape[0])
    x = (torch.randn(64, width, generator=gen) * 2).to(torch.bfloat16)
    residual = (torch.randn(64, width, generator=gen) * 2).to(torch.bfloat16)
    out = apply(x.clone(), residual.clone())

    def normed(h: torch.Tensor, style: str) -> torch.Tensor:
        scaled = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if style == "gemma":
            return (scaled * (1.0 + weight.float())).to(torch.bfloat16)
        return scaled.to(torch.bfloat16) * weight.to(torch.bfloat16)

    total = x.float() + residual.float()
    sums = {NormForm.FUSED_ADD: total, NormForm.PLAIN: total.to(torch.bfloat16).float()}
    counts = {f"{form} ({style} weight)": mismatches(normed(h, style), out) for form, h in sums.items() for style in ("llama", "gemma")}
    best = min(counts, key=lambda c: counts[c])
    if counts[best]:
        return None, CandidateEvidence(counts, why="no candidate gives the engine's norm bits")
    form = NormForm(best.split(" ")[0])
    return form, keeping(CandidateEvidence(counts), form)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

AttentionRun = Callable[[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], list[torch.Tensor]]  # one call of requests


def attention_candidates(merge_fma: bool = True) -> list[AttentionArithmetic]:
    """Every arithmetic of the engine's CPU attention this CPU can run: the AMX variants only where it has AMX tiles
    (an engine on a CPU without them never runs them, and the contract's AMX kernel needs them); each with the KV
    tiles' rescale and split-KV merge ``merge_fma`` (fused, or multiply then add: the engine's build says which)."""
    from fx_precision.contract.kernels import engine_kernels

    amx = engine_kernels().cpu_has_amx()
    out = []
    for scores, exp, reduce, fma, store in itertools.product(("amx", "vec"), ("libm", "fast512"), ("avx512", "avx2"), (False, True),
                                                             ("nearest-even", "truncate")):  # fmt: skip
        if scores == "amx" and (not amx or fma or store == "truncate" or reduce == "avx2"):
            continue  # AMX: exact bf16 products (fma changes nothing), an AVX-512 build, rounding stores
        out.append(AttentionArithmetic(scores, exp, reduce, scores == "amx", fma, store, merge_fma))  # type: ignore[arg-type]
    return out


def _contract_attention(arith: AttentionArithmetic, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        tiles: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The contract's kernel on one request: q [T, H, D] the last T positions of k / v [S, KVH, D], its rows' KV tiles
    ``tiles`` [1, T, N, 4] (None: one tile per row)."""
    offset = k.shape[0] - q.shape[0]
    return engine_attention(q[None], k[None], v[None], torch.tensor([k.shape[0]]), None, scale, True, -1, offset, **arith.op_args(),
                            kv_tiles=tiles)[0]  # fmt: skip


def call_tiles(tiling: KvTiling | None, shape: Sequence[tuple[int, int]]) -> list[torch.Tensor | None]:
    """Each request's keys as one engine call of these (query rows, keys) took them (split-KV parts, KV tiles):
    [1, T, N, 4] each (None: no tiling recorded, one tile per row)."""
    if tiling is None:
        return [None] * len(shape)
    return [tiles_tensor(rows)[None] for rows in tiling.query_row_tiles(shape)]


def _requests(shape: Sequence[tuple[int, int]], heads: int, kv_heads: int, dim: int, gen: torch.Generator,
              unit_values: bool = False) -> list[Any]:  # fmt: skip
    """Random requests of these (query rows, keys); ``unit_values``: every value 1, so each output is the P.V sum over
    the softmax sum, two fp32 sums of the same terms in the kernel's two orders, near 1: a truncating store keeps 1.0
    or drops below it by which order is which (the separating probe of the lane sums)."""
    made = []
    for q_rows, keys in shape:
        k = (torch.randn(keys, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
        v = (
            torch.ones(keys, kv_heads, dim, dtype=torch.bfloat16)
            if unit_values
            else torch.randn(keys, kv_heads, dim, generator=gen).to(torch.bfloat16)
        )
        made.append(((torch.randn(keys, heads, dim, generator=gen) * 2).to(torch.bfloat16)[keys - q_rows :].clone(), k, v))
    return made


RAMP_RISES = (0.5, 2.0, 12.0, 60.0)  # the score's rise from a request's first key to its last, per head in turn


def _ramped_requests(shape: Sequence[tuple[int, int]], heads: int, kv_heads: int, dim: int, gen: torch.Generator) -> list[Any]:
    """Requests whose scores rise with the key's position (head h by ``RAMP_RISES[h % 4]`` over the keys, slightly
    noisy): every later KV tile of a row holds larger scores than the earlier ones, so a row's softmax runs against
    another max in each tile (the max moving where a tile passes it by more than 8, its exponentials taken against the
    old max below that), and where the engine cut a row's keys shows in its bits. Random scores hide the cuts: their
    max sits in one tile or another by chance, and a row's bits part on a few rows of a thousand."""
    group = heads // kv_heads
    made = []
    for q_rows, keys in shape:
        direction = torch.nn.functional.normalize(torch.randn(kv_heads, dim, generator=gen), dim=-1)
        position = torch.arange(keys, dtype=torch.float32)[:, None, None] / max(keys - 1, 1)
        k = position * direction + 0.02 * torch.randn(keys, kv_heads, dim, generator=gen)
        rise = torch.tensor([RAMP_RISES[h % len(RAMP_RISES)] for h in range(heads)])[:, None] * dim**0.5
        q = rise * direction.repeat_interleave(group, 0) + 0.02 * torch.randn(q_rows, heads, dim, generator=gen)
        sign = 1.0 - 2.0 * (torch.arange(keys) % 2)[:, None, None]  # near-uniform weights over values of alternate sign:
        v = sign * (1 + 0.05 * torch.randn(keys, kv_heads, dim, generator=gen))  # an output far smaller than its terms
        made.append((q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)))
    return made


def match_attention(run: AttentionRun, heads: int, kv_heads: int, dim: int, gen: torch.Generator, tiling: KvTiling | None = None,
                    merge_fma: bool = True) -> tuple[AttentionArithmetic | None, AttentionEvidence]:  # fmt: skip
    """The attention arithmetic: the candidates that give every prefill probe's bits (each length alone), narrowed by
    decode rows (one query at the last position) where some candidates give theirs too. Where no candidate gives a
    decode row's bits (split-KV: keys split across threads, merged), the prefill's arithmetic is kept and ``decode``
    says a lone decode row is not followed (``check_attention_calls`` then says whether the run's calls were).
    ``merge_fma``: how the engine's build rescales across KV tiles and merges split-KV parts (fused or not); a lone
    call seldom shows it, the run's split decode rows do (``check_attention_calls``)."""
    scale = dim**-0.5
    prefill = [_requests([(n, n)], heads, kv_heads, dim, gen)[0] for n in PROBE_LENGTHS]
    decode = [_requests([(1, n)], heads, kv_heads, dim, gen)[0] for n in PROBE_LENGTHS]
    got_prefill = [run([r])[0] for r in prefill]
    got_decode = [run([r])[0] for r in decode]

    def wrong(arith: AttentionArithmetic, cases: list[Any], got: list[torch.Tensor]) -> int:
        return sum(mismatches(_contract_attention(arith, q, k, v, scale, call_tiles(tiling, [(q.shape[0], k.shape[0])])[0]), want)
                   for (q, k, v), want in zip(cases, got, strict=True))  # fmt: skip

    counts: dict[str, int] = {}
    kept = []
    for arith in attention_candidates(merge_fma):
        counts[arith.describe()] = wrong(arith, prefill, got_prefill)
        if counts[arith.describe()] == 0:
            kept.append(arith)
    from fx_precision.contract.kernels import engine_kernels

    not_tried = {} if engine_kernels().cpu_has_amx() else {"amx": "this CPU has no AMX tiles: no engine here runs them"}
    decoding = [a for a in kept if wrong(a, decode, got_decode) == 0]
    decode_note = "no candidate gives a lone decode row's bits (split-KV on several threads?)" if kept and not decoding else None
    kept = decoding or kept
    if not kept:
        return None, AttentionEvidence(counts, why="no candidate gives the engine's attention bits at prefill", not_tried=not_tried,
                                       decode=decode_note)  # fmt: skip
    separated: dict[str, int] = {}
    if len(kept) > 1:  # the separating probe: unit values, where the softmax sum's order shows through a truncating store
        separating = [_requests([(n, n)], heads, kv_heads, dim, gen, unit_values=True)[0] for n in PROBE_LENGTHS]
        got_separating = [run([r])[0] for r in separating]
        separated = {a.describe(): wrong(a, separating, got_separating) for a in kept}
        kept = [a for a in kept if separated[a.describe()] == 0] or kept
    rounds: list[dict[str, int]] = []
    for _ in range(SEPARATING_ROUNDS):  # longer prefills while two candidates remain (exp variants part on few rows)
        if len(kept) <= 1:
            break
        longer = [_requests([(n, n)], heads, kv_heads, dim, gen)[0] for n in SEPARATING_LENGTHS]
        got_longer = [run([r])[0] for r in longer]
        counts_longer = {a.describe(): wrong(a, longer, got_longer) for a in kept}
        rounds.append(counts_longer)
        kept = [a for a in kept if counts_longer[a.describe()] == 0] or kept
    # indistinguishable on these probes: the first in candidate order, recorded as ambiguous
    found = AttentionEvidence(counts, not_tried=not_tried, decode=decode_note, separating=separated, separating_rounds=tuple(rounds),
                              ambiguous=len(kept) if len(kept) > 1 else 0)  # fmt: skip
    return kept[0], keeping(found, kept[0])


MAX_RUN_CALLS = 512  # distinct attention calls of the run checked whole (decode steps are cheap); past it, the notes say so


def check_attention_calls(run: AttentionRun, arith: AttentionArithmetic, shapes: Sequence[Sequence[tuple[int, int]]], heads: int,
                          kv_heads: int, dim: int, gen: torch.Generator,
                          seen: dict[tuple[tuple[int, int], ...], str | None] | None = None,
                          tiling: KvTiling | None = None) -> RunCallsChecked:  # fmt: skip
    """The kept arithmetic against the engine's attention at the calls the run made (``shapes``: each call's requests
    as (query rows, keys), all in one call, with the engine's threads, split-KV setting and scheduler): where the
    engine's order depends on the batch, the lengths or its threads (KV tiles and their rescaling, split-KV), this is
    where it shows. ``unmatched`` lists the calls whose rows part. ``seen``: calls checked before (a live engine's
    earlier runs; what each gave), kept up to date, so a run checks only the calls it is the first to make."""
    scale = dim**-0.5
    seen = {} if seen is None else seen
    calls = [tuple(shape) for shape in shapes]
    for shape in [c for c in calls if c not in seen][:MAX_RUN_CALLS]:
        wrong = 0
        for requests in (_requests(shape, heads, kv_heads, dim, gen), _ramped_requests(shape, heads, kv_heads, dim, gen)):
            got = run(requests)
            wrong += sum(int((_contract_attention(arith, q, k, v, scale, tiles) != want).any(-1).any(-1).sum())
                         for (q, k, v), want, tiles in zip(requests, got, call_tiles(tiling, shape), strict=True))  # fmt: skip
        more = "..." if len(shape) > 3 else ""
        seen[shape] = f"{len(shape)} request(s) {list(shape)[:3]}{more}: {wrong} row(s) differ" if wrong else None
    return RunCallsChecked(len(calls), sum(1 for c in calls if c in seen), tuple(str(seen[c]) for c in calls if seen.get(c)))


# ---------------------------------------------------------------------------------------------
# linears
# ---------------------------------------------------------------------------------------------

PROBE_OUTPUTS = 256  # targeted outputs a linear call is read on (more trials where a call holds fewer rows)
MAX_TRIALS = 256
PROBE_ROUNDS = 4  # rounds of trials at most, while two orders still give every probed output
SEPARATING_LINEAR_ROUNDS = 2  # then rounds of trials at the block starts where two pairs orders part (boundary_rows)
APART_FINALISTS = 4  # orders tried on every output of a call read apart: those best on the sampled rows


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


def targeted_rows(weight: torch.Tensor, rows: int, trial: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
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


def block_starts(orders: Sequence[LinearOrder]) -> tuple[int, ...]:
    """The K elements where a VDPBF16PS pairs order among ``orders`` starts a block or part after the first (its pair's
    even element; the odd one is added first): where two such orders part, if anywhere."""
    pairs = (order for order in orders if order.kernel == LinearKernel.PAIRS)
    return tuple(sorted({LinearKernel.PAIRS.unit * pair for order in pairs for pair in itertools.accumulate(order.blocks[:-1])}))


def boundary_rows(weight: torch.Tensor, rows: int, gen: torch.Generator, starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs that tell pairs orders apart at one block start b each (``starts`` in turn): three products, all else 0,
    a large one L at a random i early in K, its exact negative at b + 1 (the pair's odd element, added first) and a
    fraction of L's ulp at b. An order that sums on through b cancels L and then adds the fraction exactly; one that
    starts a block (or part) at b sums the block from 0, rounding the fraction on L's grid, and adds the block: 0 or
    one ulp. The two large products cross their weights, x_i = c |w_(b+1)| and x_(b+1) = -c |w_i| (signs to match,
    c a power of two that puts L in [1, 2)), so they cancel exactly for any two nonzero weights; random and targeted
    products leave a block of one pair at K's end unseen. (x, n_m)."""
    n, k = weight.shape
    x = torch.zeros(rows, k)
    targets = torch.randint(0, n, (rows,), generator=gen)
    for m in range(rows):
        b = starts[m % len(starts)]
        w = weight[int(targets[m])].float()
        early = (w[:b] != 0).nonzero().flatten()
        if w[b] == 0 or w[b + 1] == 0 or not early.numel():  # b + 1 < K: a block start is a pair's even element
            continue  # a row of zeros: every order gives 0 (the other rows part the orders)
        i = int(early[int(torch.randint(0, early.numel(), (1,), generator=gen))])
        c = 2.0 ** -math.floor(math.log2(float(w[i].abs() * w[b + 1].abs())))  # L = c |w_i w_(b+1)| in [1, 2)
        x[m, i] = c * w[b + 1].abs() * w[i].sign()  # bf16 exactly (a bf16 weight times a power of two)
        x[m, b + 1] = -c * w[i].abs() * w[b + 1].sign()
        x[m, b] = (0.1 + 0.8 * float(torch.rand(1, generator=gen))) * 2.0**-23 / float(w[b])  # a fraction of L's ulp
    return x.to(torch.bfloat16), targets


LinearRun = Callable[[torch.Tensor], torch.Tensor]  # the engine's linear on [M, K] bf16 rows -> [M, N]


def linear_families(k: int, threads: int, has_bias: bool, out_features: int = 0) -> tuple[list[LinearOrder], dict[str, str]]:
    """The candidate orders a linear of K inputs is read against, the cheapest family first, and the families not
    tried on this CPU with why: torch's lanes (one order), oneDNN's 1-wide GEMVs (a 1-wide output only), the AMX chunk
    orders (only where this CPU runs AMX tiles: an engine here cannot have run them), SGL's small-batch pairs from the
    bias (a linear with a bias: without one it is the plain pairs order), the VDPBF16PS pairs orders."""
    from fx_precision.contract.kernels import engine_kernels

    candidates = [LinearOrder.sequential(k, LinearKernel.LANES)]
    not_tried: dict[str, str] = {}
    if out_features == 1:  # oneDNN's GEMVs take a 1-wide output (its 16-column brgemm every wider one)
        candidates += [LinearOrder.sequential(k, gemv) for gemv in GEMVS]
    else:
        not_tried.update({str(gemv): "the GEMV kernel computes 1-wide outputs only" for gemv in GEMVS})
    if engine_kernels().cpu_has_amx():
        candidates += candidate_orders(k, threads, LinearKernel.AMX_CHUNKS)
    else:
        not_tried[str(LinearKernel.AMX_CHUNKS)] = "this CPU has no AMX tiles: no engine here runs them"
    if k % 2 == 0:
        if has_bias:
            candidates.append(LinearOrder.sequential(k, LinearKernel.PAIRS, bias_first=True))
        candidates += candidate_orders(k, threads, LinearKernel.PAIRS)
    else:
        not_tried[str(LinearKernel.PAIRS)] = f"K = {k} is odd: the pairs kernels take whole K pairs"
    return list(dict.fromkeys(candidates)), not_tried


def _folded(order: LinearOrder, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
            dots: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """[P] bf16: output i = x_i . w_i (+ bias_i) in ``order`` (an AMX order from the chunk dots ``dots``)."""
    from fx_precision.contract.kernels import engine_kernels

    kernels = engine_kernels()
    if order.kernel == LinearKernel.AMX_CHUNKS:
        assert dots is not None
        return kernels.order_fold(dots, bias, order.struct())
    return kernels.product_fold(x, w, bias, order.struct())


def _giving(orders: list[LinearOrder], x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
            want: torch.Tensor) -> list[LinearOrder]:  # fmt: skip
    """The orders that give every output ``want`` (output i = x_i . w_i + bias_i): the AMX chunk orders by folding the
    outputs' chunk dots, the others output by output in C, on 2 outputs, then 16, then all (most fail on the first)."""
    from fx_precision.contract.kernels import engine_kernels

    amx = [o for o in orders if o.kernel == LinearKernel.AMX_CHUNKS]
    dots = engine_kernels().chunk_dots(x, w) if amx else None
    kept = []
    for order in orders:
        if order.kernel == LinearKernel.AMX_CHUNKS:
            if torch.equal(_folded(order, x, w, bias, dots), want):
                kept.append(order)
            continue
        if all(torch.equal(_folded(order, x[:n], w[:n], bias[:n] if bias is not None else None, None), want[:n])
               for n in (2, 16, x.shape[0])):  # fmt: skip
            kept.append(order)
    return kept


def _fits(orders: list[LinearOrder], x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
          want: torch.Tensor) -> dict[LinearOrder, torch.Tensor]:  # fmt: skip
    """Per order, [P] bool: which probed outputs it gives bit for bit."""
    from fx_precision.contract.kernels import engine_kernels

    dots = engine_kernels().chunk_dots(x, w) if any(o.kernel == LinearKernel.AMX_CHUNKS for o in orders) else None
    return {o: _folded(o, x, w, bias, dots).view(torch.int16) == want.view(torch.int16) for o in orders}


def _apart(orders: list[LinearOrder], x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, want: torch.Tensor,
           index: torch.Tensor, rows: int) -> tuple[LinearOrder, dict[int, list[LinearOrder]]] | None:  # fmt: skip
    """The call's main order, the one that gives the most of its row indices (``index``: each probed output's row in the
    call), and for each row index it does not give, the orders that do (None: a row no order gives). Every order is
    tried on the outputs of up to 32 row indices spread over the call, the ``APART_FINALISTS`` that give the most of them
    on all; every order then on the outputs of the rows the main one misses."""

    def given(fit: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [rows] bool: every output of the row given
        return torch.zeros(rows, dtype=torch.int32).index_add_(0, at, (~fit).to(torch.int32)) == 0

    spread = torch.unique(torch.linspace(0, rows - 1, min(rows, 32)).round().long())
    sampled = torch.isin(index, spread)
    picked_bias = bias[sampled] if bias is not None else None
    on_sample = _fits(orders, x[sampled], w[sampled], picked_bias, want[sampled])
    counts = {o: int(given(fit, index[sampled])[spread].sum()) for o, fit in on_sample.items()}
    best = max(counts.values())
    finalists = [o for o in orders if counts[o] == best][:APART_FINALISTS]
    whole = {o: given(fit, index) for o, fit in _fits(finalists, x, w, bias, want).items()}
    main = max(finalists, key=lambda o: (int(whole[o].sum()), -finalists.index(o)))
    missed = (~whole[main]).nonzero().flatten()
    if not missed.numel():
        return main, {}
    mine = torch.isin(index, missed)
    on_missed = _fits(orders, x[mine], w[mine], bias[mine] if bias is not None else None, want[mine])
    given_by = {o: given(fit, index[mine]) for o, fit in on_missed.items()}
    apart = {i: [o for o in orders if bool(given_by[o][i])] for i in missed.tolist()}
    return (main, apart) if all(apart.values()) else None


def read_linear_order(call: LinearRun, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, threads: int,
                      gen: torch.Generator) -> tuple[LinearCall | None, LinearCallEvidence]:  # fmt: skip
    """What the engine's linear ``call`` sums in when it holds ``rows`` rows (contract/linear_order.py).
    Trials of targeted inputs gather ``PROBE_OUTPUTS`` probed outputs; every candidate of every family this CPU's
    engine can run (``linear_families``) is computed for those outputs and kept when it gives all their bits; what is
    left is then run whole (every output of the last targeted trial, by the kernel the training side runs) before one is
    returned. Orders that still agree are recorded. Where no one order gives every row, the rows are read apart: the
    order that gives the most row indices of the call, and for each other index the order that gives it (more rounds of
    trials while one agrees with another there); the whole call is then run as so read."""
    from fx_precision.contract.kernels import engine_kernels

    kernels = engine_kernels()
    n, k = weight.shape
    trials = max(3, min(MAX_TRIALS, -(-PROBE_OUTPUTS // rows)))
    families, not_tried = linear_families(k, threads, bias is not None, n)
    found = families
    probed = 0
    seen_x, seen_cols, seen_want = [], [], []
    targeted: list[tuple[torch.Tensor, torch.Tensor]] = []  # the targeted trials' (x, engine's output), the latest last

    def trial_round(starts: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:
        nonlocal probed
        xs, wants, cols = [], [], []
        for trial in range(trials):
            x, targets = boundary_rows(weight, rows, gen, starts) if starts else targeted_rows(weight, rows, trial, gen)
            got = call(x.clone())
            if tuple(got.shape) != (rows, n) or got.dtype != torch.bfloat16:
                return f"the engine's call returned {tuple(got.shape)} {got.dtype} for {rows} rows of {k}: not a bf16 GEMM"
            wants.append(got[torch.arange(rows), targets])
            xs.append(x)
            cols.append(targets)
            if not starts:  # the whole call is checked on targeted rows (boundary rows hold three products a row)
                targeted.append((x, got))
        probed += rows * trials
        seen_x.extend(xs)
        seen_cols.extend(cols)
        seen_want.extend(wants)
        return torch.cat(xs), torch.cat(cols), torch.cat(wants)

    for round_ in range(PROBE_ROUNDS + SEPARATING_LINEAR_ROUNDS):  # a round of trials; another while two orders give them all
        separating = round_ >= PROBE_ROUNDS
        starts = block_starts(found) if separating else ()
        if separating and not starts:
            break  # no pairs orders left to part at a block start
        got_round = trial_round(starts)
        if isinstance(got_round, str):
            return None, LinearCallEvidence(rows, why=got_round)
        all_x, all_cols, want = got_round
        picked_bias = bias.float()[all_cols] if bias is not None else None
        found = _giving(found, all_x, weight[all_cols].contiguous(), picked_bias, want)
        if len(found) <= 1:
            break
    evidence = LinearCallEvidence(rows, probed, len(found), dict(not_tried))
    if not targeted:
        return None, replace(evidence, why="no order of the families tried gives the engine's bits")
    if not found:
        return _read_apart(call, weight, bias, rows, families, (seen_x, seen_cols, seen_want), targeted, trial_round, evidence)
    x, got = targeted[-1]
    with _all_threads():
        whole = [o for o in found[:2] if torch.equal(kernels.linear(x, weight, bias, o.struct()), got)]
    if not whole:
        return None, replace(evidence, why="the orders the probed outputs kept differ from the engine on other outputs")
    ambiguous = tuple(o.describe() for o in whole) if len(whole) > 1 else ()
    return LinearCall(n, k, rows, whole[0]), keeping(replace(evidence, ambiguous=ambiguous), whole[0])


def _read_apart(call: LinearRun, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, families: list[LinearOrder],
                seen: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
                targeted: list[tuple[torch.Tensor, torch.Tensor]],
                trial_round: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str],
                evidence: LinearCallEvidence) -> tuple[LinearCall | None, LinearCallEvidence]:  # fmt: skip
    """``read_linear_order`` where no one order gives every row of the call: each row index read apart on every output
    probed so far (``seen``), more rounds while an index is given by more than one order, then the whole call checked on
    the latest targeted trial's rows (``targeted``, which ``trial_round`` extends)."""
    from fx_precision.contract.kernels import engine_kernels

    n, k = weight.shape
    xs, cols, wants = seen
    read: tuple[LinearOrder, dict[int, list[LinearOrder]]] | None = None
    for round_ in range(PROBE_ROUNDS + 1):
        all_x, all_cols, want = torch.cat(xs), torch.cat(cols), torch.cat(wants)
        index = torch.arange(all_x.shape[0]) % rows
        picked_bias = bias.float()[all_cols] if bias is not None else None
        read = _apart(families, all_x, weight[all_cols].contiguous(), picked_bias, want, index, rows)
        if read is None or all(len(kept) == 1 for kept in read[1].values()) or round_ == PROBE_ROUNDS:
            break
        more = trial_round()
        if isinstance(more, str):
            return None, replace(evidence, why=more)
    evidence = replace(evidence, probed_outputs=sum(int(w.numel()) for w in wants))
    if read is None:
        return None, replace(evidence, why="no order of the families tried gives the engine's bits, one row or another")
    main, apart = read
    x = targeted[-1][0]
    got = call(x.clone())
    order_of = {i: kept[0] for i, kept in apart.items()}
    with _all_threads():
        computed = engine_kernels().linear(x, weight, bias, main.struct())
        for i, order in order_of.items():
            computed[i] = engine_kernels().linear(x[i : i + 1].contiguous(), weight, bias, order.struct())[0]
    if not torch.equal(computed, got):
        return None, replace(evidence, why="the orders read row by row differ from the engine on other outputs")
    ambiguous = tuple(f"row {i}: {o.describe()}" for i, kept in apart.items() if len(kept) > 1 for o in kept[:2])
    found = LinearCall(n, k, rows, main, tuple(sorted(order_of.items())))
    kept_main = keeping(replace(evidence, candidates_left=1, ambiguous=ambiguous), main)
    summary = "; ".join(f"row {i}: {o.describe()}" for i, o in found.apart)
    return found, replace(kept_main, kept=f"{main.describe()}; apart: {summary}"[:400],
                          record={**(kept_main.record or {}), "apart": {str(i): o.to_dict() for i, o in found.apart}})  # fmt: skip


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


def read_linear_calls(calls: dict[str, tuple[LinearRun, torch.Tensor, torch.Tensor | None, bool]], body_rows: set[int],
                      logits_rows: set[int], threads: int, gen: torch.Generator,
                      seen: dict[tuple[int, int, int], tuple[str, LinearCall | None, LinearCallEvidence]] | None = None,
                      ) -> tuple[LinearOrders, LinearEvidence]:  # fmt: skip
    """The order of every linear call the run made: ``calls`` name -> (call, bf16 weight, bias, is the output
    projection); each at every step size of the run (the logits one at every logits call's size). Linears of one
    shape share the calls' orders: each shape is read once per size. ``seen``: (N, K, rows) -> (name, order,
    evidence) read before on this engine (an order depends on the shape, the rows and the threads, not the weights'
    values), kept up to date: a run reads only the calls it is the first to make, and the contract holds them all."""
    seen = {} if seen is None else seen
    for name, (call, weight, bias, logits) in calls.items():
        n, k = weight.shape
        for rows in sorted(logits_rows if logits else body_rows):
            if (n, k, rows) not in seen:
                seen[(n, k, rows)] = (name, *read_linear_order(call, weight, bias, rows, threads, gen))
    found_calls: dict[str, LinearCallEvidence] = {}
    orders_read: dict[str, dict[str, Any]] = {}
    unmatched: list[str] = []
    calls_read: list[LinearCall] = []
    for (n, k, rows), (name, linear, found) in sorted(seen.items()):
        found_calls[f"{name} {n}x{k} at {rows} rows"] = found
        if linear is None:
            unmatched.append(f"{name} at {rows} rows")
        else:
            calls_read.append(linear)
            orders_read[linear_call_key(n, k, rows)] = value_record(linear.order)
    why = f"no order gives the engine's bits for {', '.join(unmatched[:3])}" if unmatched else None
    return LinearOrders(threads, tuple(calls_read)), LinearEvidence(found_calls, orders_read, tuple(unmatched), why)


# ---------------------------------------------------------------------------------------------
# log-probs
# ---------------------------------------------------------------------------------------------


def _sampled_rows(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]], step: int) -> list[tuple[int, int]]:
    """(sequence, position) of every row the engine computed at ``step`` whose next token it sampled."""
    rows = []
    for s, found in enumerate(steps_of(sequences, steps)):
        tokens, prompt_len = sequences[s].tokens, sequences[s].prompt_len
        rows += [(s, p) for p, f in enumerate(found) if f == step and prompt_len <= p + 1 < len(tokens)]
    return rows


def match_logprobs(generation: Generation) -> tuple[LogprobForm | None, LogprobEvidence]:
    """Which log-probs the engine returned for the tokens it sampled, read off the logits its sampler drew from.

    ``generation.sampled_logits`` is (step, the logits calls of that step); every row of them is held against
    every (sequence, position) the step computed and sampled after: the log-prob the engine returned for that
    token against the fp32 ``log_softmax`` of the logits as they are (raw) and as the sampler drew from them
    (processed: at the temperature, renormalised over the request's top-k and top-p; logprobs.processed_logprobs).
    A row is checked where one candidate gives a returned value bit for bit; the form kept is the one every checked
    row gives. With no top-k or top-p, at temperature 0 or 1 both forms are one computation."""
    from fx_precision.logprobs import processed_logprobs, processing_is_identity

    captured = generation.sampled_logits
    if captured is None:
        return None, LogprobEvidence(why="the engine's sampled logits were not captured")
    step, calls = captured
    temperature = float(generation.temperature)
    top_k, top_p = int(getattr(generation, "top_k", 0)), float(getattr(generation, "top_p", 1.0))
    one = processing_is_identity(temperature, top_k, top_p)  # raw and processed are one computation
    candidates = _sampled_rows(generation.sequences, generation.steps, int(step))
    if not candidates:
        return None, LogprobEvidence(int(step), temperature, top_k, top_p, why=f"no sampled token was computed at step {step}")
    wanted = {(s, p): float(generation.logprobs[s][p]) for s, p in candidates}
    forms = (LogprobForm.RAW, LogprobForm.PROCESSED)
    checked: dict[LogprobForm, int] = {form: 0 for form in forms}
    rows = 0
    for logits in calls:
        x = logits.float()
        by_form = {LogprobForm.RAW: torch.log_softmax(x, -1)}
        by_form[LogprobForm.PROCESSED] = by_form[LogprobForm.RAW] if one else processed_logprobs(x, temperature, top_k, top_p)
        for r in range(x.shape[0]):
            rows += 1
            for form in forms:
                lp = by_form[form][r]
                if any(float(lp[generation.sequences[s].tokens[p + 1]]) == value for (s, p), value in wanted.items()):
                    checked[form] += 1
    evidence = LogprobEvidence(int(step), temperature, top_k, top_p, rows, len(candidates), {str(f): n for f, n in checked.items()})
    best = max(forms, key=lambda f: checked[f])
    if checked[best] == 0:
        return None, replace(evidence, why="no candidate gives the returned log-probs")
    if one:  # one computation: either name holds
        return LogprobForm.RAW, keeping(evidence, LogprobForm.RAW)
    if checked[LogprobForm.RAW] and checked[LogprobForm.PROCESSED]:
        return None, replace(evidence, why="rows give both forms")
    return best, keeping(evidence, best)
