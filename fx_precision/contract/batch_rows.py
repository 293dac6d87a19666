"""Which engine call computed each row: the engine's GEMMs sum in an order that depends on how many rows a call holds.

The engine runs a forward per scheduler step over every token the step holds (the prompts it prefills,
one token of each request it decodes), and computes logits in calls of their own (a request's prompt
log-probs; one row per request when it samples). Its GEMM library picks its K blocking per call from the
row count (contract/linear_order.py), so a teacher-forced training forward, which computes every row in
one batch, must know the size of the engine call each row came from. The rollout records them::

    engine steps     [[(position, token), ...] per forward]      logits calls   [(step, rows), ...]
    row plan of sequence s (T tokens, prompt P)
    ├── body[r]      rows of the forward that computed row r                    (all the body's linears)
    └── logits[r]    rows of the logits call that computed row r's logits (the log-prob of token r + 1):
                     r < P - 1: the prompt-log-prob call of this request in that step (its rows < P - 1)
                     r >= P - 1: the sampling call of that step (one row per request in the step)
                     0 where the engine never computed the row (the last sampled token is never fed)

``check_logits_calls`` compares the calls this predicts with the ones recorded; ``row_plans`` refuses a
dump whose calls differ (the engine batched its logits otherwise, and the plan would be wrong).
``EngineRows`` is a training batch's plans as tensors with the contract's linear orders; ``engine_rows``
makes it the one ``fxp_engine.linear`` reads while a forward runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from fx_precision.contract.attention_tiles import ONE_TILE, KvTiling, RowTiles, tiles_tensor
from fx_precision.contract.linear_order import LinearOrders
from fx_precision.errors import PrecisionError


class TokenSequence(Protocol):
    """What a plan reads of a dump's sequence (``dump.Sequence``): its tokens, prompt then generated. A protocol, not
    an import: the dump reads this module's plans, so the plans do not import the dump."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def prompt_len(self) -> int: ...


NOT_PLANNED = -1  # a row index the plan does not hold (RowPlan.body_at / logits_at): fxp_engine.linear refuses to guess it


@dataclass(frozen=True)
class RowPlan:
    """Per token row of one sequence: the rows of the engine call that computed it (0: never computed), and where
    that call's attention took the row's keys in (its split-KV parts and KV tiles: attention_tiles.RowTiles)."""

    body: tuple[int, ...]  # one per token
    logits: tuple[int, ...]  # one per token but the last
    kv_tiles: tuple[RowTiles, ...] | None = None  # one per token; None: not planned (one tile per row)
    gdn: tuple[int, ...] | None = None  # one per token: the first row of the engine piece that prefilled it, or contract.gdn's
    # GDN_DECODE / GDN_NONE (None: no GatedDeltaNet layer in the model)
    body_at: tuple[int, ...] | None = None  # one per token: its row index in the engine forward that computed it
    logits_at: tuple[int, ...] | None = None  # one per token but the last: its row index in its logits call (None: not planned)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, T] int32 each (the logits row of the last token: 0)."""
        return torch.tensor([self.body], dtype=torch.int32), torch.tensor([(*self.logits, 0)], dtype=torch.int32)

    def at_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``body_at`` and ``logits_at`` as [1, T] int32 (``NOT_PLANNED`` where the plan holds no row index)."""
        body = self.body_at if self.body_at is not None else (NOT_PLANNED,) * len(self.body)
        logits = self.logits_at if self.logits_at is not None else (NOT_PLANNED,) * len(self.logits)
        return torch.tensor([body], dtype=torch.int32), torch.tensor([(*logits, 0)], dtype=torch.int32)


def _steps(engine: dict[str, Any]) -> list[list[tuple[int, int]]]:
    steps = engine.get("steps")
    if not steps:
        raise PrecisionError(
            "the engine dump records no forward steps (engine.steps); write it again with fx-precision rollout of this version"
        )
    return [[(int(p), int(t)) for p, t in rows] for rows in steps]


def steps_of(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]]) -> list[list[int | None]]:
    """For each sequence, the engine step that computed each of its rows (None: never computed): the step of the
    request that fed it, or for a row no request of the sequence fed, whose whole prefix another sequence shares
    (the engine's prefix cache: G samples of one prompt, the KV of its blocks computed once, in the same step or an
    earlier one), the step of the request that computed it (``_claimed``)."""
    return _claimed(sequences, steps).steps


@dataclass(frozen=True)
class Claims:
    """Which engine request computed each row (``_claimed``), per sequence: ``steps`` each row's step (None: never
    computed), ``fed`` the steps the sequence fed rows in itself (its requests: the engine computes their logits),
    ``sources`` the sequence whose request computed each row (itself, or the one a prefix-cache hit read), and
    ``requests`` step -> the index of the sequence's own request in that step (``step_requests``' order)."""

    steps: list[list[int | None]]
    fed: list[set[int]]
    sources: list[list[int]]
    requests: list[dict[int, int]]


def _prefix_ids(sequences: Sequence[TokenSequence]) -> list[list[int]]:
    """Per sequence, per row: an id of the tokens up to and with that row (one id per distinct prefix: a trie)."""
    trie: dict[tuple[int, int], int] = {}
    out = []
    for s in sequences:
        ids, node = [], -1
        for token in s.tokens:
            node = trie.setdefault((node, int(token)), len(trie))
            ids.append(node)
        out.append(ids)
    return out


def _claimed(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]]) -> Claims:
    """Each step's requests (``step_requests``) matched to sequences in the step's order: a request of rows
    [start, keys) is the first sequence's, in the dump's order, that holds those tokens there, has none of its own in
    the step yet, and has every row before ``start`` computed (by its own earlier requests, or by a prefix-cache hit:
    a request of any sequence, this step or an earlier one, that computed the same prefix). Rows are matched as whole
    requests, never token by token: two prompts may hold one token at one position."""
    tokens = [[int(t) for t in s.tokens] for s in sequences]
    prefixes = _prefix_ids(sequences)
    found: list[list[int | None]] = [[None] * len(t) for t in tokens]
    sources = [[i] * len(t) for i, t in enumerate(tokens)]
    fed: list[set[int]] = [set() for _ in tokens]
    requests: list[dict[int, int]] = [{} for _ in tokens]
    progress = [0] * len(tokens)  # per sequence: the first row not yet computed
    computed: dict[int, tuple[int, int]] = {}  # prefix id -> (step, sequence) of the request that computed its last row
    for step, (rows, runs) in enumerate(zip(steps, step_requests(sequences, steps), strict=True)):
        offset = 0
        for index, (q, keys) in enumerate(runs):
            start, run = keys - q, [t for _, t in rows[offset : offset + q]]
            offset += q
            for i, held in enumerate(tokens):
                if step in fed[i] or progress[i] > start or held[start:keys] != run:
                    continue
                gap = range(progress[i], start)
                if any(prefixes[i][r] not in computed for r in gap):
                    continue
                for r in gap:  # prefix-cache hits: the rows another request computed
                    found[i][r], sources[i][r] = computed[prefixes[i][r]]
                for r in range(start, keys):
                    found[i][r] = step
                    computed.setdefault(prefixes[i][r], (step, i))
                progress[i], requests[i][step] = keys, index
                fed[i].add(step)
                break
    return Claims(found, fed, sources, requests)


def _predicted_calls(sequences: Sequence[TokenSequence], step_of: list[list[int | None]], fed_steps: list[set[int]],
                     prompt_logprobs: bool = True) -> tuple[Counter[tuple[int, int]], Counter[int]]:  # fmt: skip
    """The logits calls the plan assumes, (step, rows) -> count, and the requests each step samples for: each request
    that fed rows in the step (a chunk of a prompt too; rows a prefix-cache hit gave it are no request of that step),
    a request's prompt-log-prob call only where the engine was asked for prompt log-probs."""
    predicted: Counter[tuple[int, int]] = Counter()
    requests: Counter[int] = Counter()
    for s, found, fed in zip(sequences, step_of, fed_steps, strict=True):
        for step in fed:
            requests[step] += 1
            prompt_rows = sum(1 for q, f in enumerate(found) if f == step and q < s.prompt_len - 1)
            if prompt_rows and prompt_logprobs:
                predicted[(step, prompt_rows)] += 1
    for step, n in requests.items():
        predicted[(step, n)] += 1
    return predicted, requests


def check_logits_calls(sequences: Sequence[TokenSequence], engine: dict[str, Any]) -> str | None:
    """None when the recorded logits computations are the ones the plan assumes, else what differs."""
    steps = _steps(engine)
    claims = _claimed(sequences, steps)
    predicted, _ = _predicted_calls(sequences, claims.steps, claims.fed, bool(engine.get("prompt_logprobs", True)))
    recorded = Counter((int(a), int(b)) for a, b in engine.get("logits_calls") or [])
    if recorded == predicted:
        return None
    missing = sorted((predicted - recorded).elements())[:4]
    extra = sorted((recorded - predicted).elements())[:4]
    return f"the engine computed logits in other batches than assumed (expected but absent: {missing}; recorded, unexpected: {extra})"


def row_plans(sequences: Sequence[TokenSequence], engine: dict[str, Any], *, with_logits: bool = True,
              tiling: KvTiling | None = None, gdn: bool = False) -> list[RowPlan]:  # fmt: skip
    """The row plan of every sequence (module docstring), after the recorded logits calls are checked against it
    (``with_logits=False``: the body's rows only, the logits plan left at 0); ``tiling``: each row's KV tiles too,
    as the engine's attention placed them in the step that computed the row; ``gdn`` (the contract follows
    GatedDeltaNet layers: ``EngineContract.gdn``): how those layers computed each row, its piece or a decode."""
    steps = _steps(engine)
    claims = _claimed(sequences, steps)
    step_of, fed_steps = claims.steps, claims.fed
    differs = check_logits_calls(sequences, engine) if with_logits else None
    if differs is not None:
        raise PrecisionError(
            f"the engine's row plan cannot be followed: {differs}. Roll out again with fx-precision rollout of this version"
        )
    prompt_logprobs = bool(engine.get("prompt_logprobs", True))
    _, requests = _predicted_calls(sequences, step_of, fed_steps, prompt_logprobs)
    in_step = step_requests(sequences, steps)
    plans = []
    for i, (s, found, computed) in enumerate(zip(sequences, step_of, _rows_requests(claims, in_step), strict=True)):
        body = tuple(len(steps[f]) if f is not None else 0 for f in found)
        body_at = tuple(0 if at is None else sum(q for q, _ in in_step[at[0]][: at[1]]) + r - (at[3] - at[2])
                        for r, at in enumerate(computed))  # fmt: skip
        logits, logits_at = [], []
        prompt_rows: dict[int, list[int]] = {}  # step -> the prompt rows (but the last) it computed: its prompt-log-prob call
        for q, at in enumerate(found[: max(s.prompt_len - 1, 0)]):
            if at is not None:
                prompt_rows.setdefault(at, []).append(q)
        for r in range(len(s.tokens) - 1):
            step = found[r]
            if step is None or not with_logits:
                logits.append(0)
                logits_at.append(0)
            elif r < s.prompt_len - 1:
                prompt = prompt_rows[step]
                logits.append(len(prompt) if prompt_logprobs else 0)  # no prompt log-probs: those rows' logits never computed
                logits_at.append(r - prompt[0] if prompt_logprobs else 0)
            else:
                logits.append(requests[step])
                logits_at.append(_sampling_index(claims, i, step))
        plans.append(RowPlan(body, tuple(logits), body_at=body_at, logits_at=tuple(logits_at)))
    if tiling is not None:
        tiles = kv_tiles_of(sequences, steps, claims, tiling)
        plans = [replace(p, kv_tiles=t) for p, t in zip(plans, tiles, strict=True)]
    if gdn:
        pieces = gdn_pieces_of(sequences, steps, claims)
        plans = [replace(p, gdn=g) for p, g in zip(plans, pieces, strict=True)]
    return plans


def _sampling_index(claims: Claims, sequence: int, step: int) -> int:
    """The row of ``sequence``'s request in ``step``'s sampling call: one row per request that fed rows in the step, in the
    step's order (the requests of other sequences before it)."""
    mine = claims.requests[sequence].get(step)
    if mine is None:
        raise PrecisionError(f"engine rows: a sequence sampled at engine step {step} holds no request there; roll out again")
    return sum(1 for other in claims.requests if other.get(step, mine) < mine)


GDN_DECODE, GDN_NONE = -1, -2  # contract/gdn.py's codes (there with what they mean)


def gdn_pieces_of(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]], claims: Claims) -> list[tuple[int, ...]]:
    """Per sequence, per row: how the engine's GatedDeltaNet layers computed it, from the request that computed it (the
    sequence's own, or for a prefix-cache hit the request of the sequence it read): a request with no state yet (its
    first piece, of any length) or of several rows prefilled them as one piece (the row's code: the piece's first row);
    a one-row request with a state went through the decode kernel (``GDN_DECODE``); a row no request computed
    ``GDN_NONE``. vLLM splits a step's requests so (gdn_attn.py: decode threshold 1, a first chunk is a prefill)."""
    requests = step_requests(sequences, steps)
    return [tuple(GDN_NONE if at is None else GDN_DECODE if at[2] == 1 and at[3] > 1 else at[3] - at[2] for at in rows)
            for rows in _rows_requests(claims, requests)]  # fmt: skip


def _rows_requests(claims: Claims, requests: list[list[tuple[int, int]]]) -> list[list[tuple[int, int, int, int] | None]]:
    """Per sequence, per row: (engine step, request index in it, its query rows, its keys) of the request that computed
    the row (``claims``: the sequence's own, or a prefix-cache hit's source), None where no step computed it."""
    out = []
    for i, found in enumerate(claims.steps):
        rows: list[tuple[int, int, int, int] | None] = []
        for r, step in enumerate(found):
            if step is None:
                rows.append(None)
                continue
            index = claims.requests[claims.sources[i][r]].get(step)
            if index is None:
                raise PrecisionError(f"engine rows: row {r} of a sequence is in no request of engine step {step}; roll out again")
            rows.append((step, index, *requests[step][index]))
        out.append(rows)
    return out


def step_requests(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """Each engine step's requests as the attention call held them, in the step's order: (query rows, keys) per run
    of the step's rows at consecutive positions that is a slice of some sequence (a request's rows are consecutive;
    a run no sequence holds whole is cut where it stops matching one)."""
    tokens = [[int(t) for t in s.tokens] for s in sequences]

    def holds(i: int, position: int, token: int) -> bool:
        return len(tokens[i]) > position and tokens[i][position] == token

    out = []
    for rows in steps:
        requests: list[tuple[int, int]] = []
        start = 0
        while start < len(rows):
            holders = [i for i in range(len(tokens)) if holds(i, *rows[start])]
            end = start + 1
            while end < len(rows) and rows[end][0] == rows[end - 1][0] + 1:
                still = [i for i in holders if holds(i, *rows[end])]
                if not still:
                    break
                holders = still
                end += 1
            requests.append((end - start, rows[end - 1][0] + 1))
            start = end
        out.append(requests)
    return out


def kv_tiles_of(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]], claims: Claims,
                tiling: KvTiling) -> list[tuple[RowTiles, ...]]:  # fmt: skip
    """Per sequence, per row: how the engine step that computed it took its keys (split-KV parts, KV tiles), in the
    request that computed the row (``claims``: the sequence's own, or for a prefix-cache hit the request of the
    sequence it read; the engine splits KV per request, by its place among the threads' work); one tile where no step
    computed a row."""
    requests = step_requests(sequences, steps)
    per_step = [tiling.query_row_tiles(r) for r in requests]
    return [tuple(ONE_TILE if at is None else per_step[at[0]][at[1]][r - (at[3] - at[2])] for r, at in enumerate(rows))
            for rows in _rows_requests(claims, requests)]  # fmt: skip


@dataclass(frozen=True)
class EngineRows:
    """A training batch's row plans ([B, T] int32 each: rows of the engine call per row, 0 where none) and the
    contract's linear orders: what ``fxp_engine.linear`` computes each row with."""

    body: torch.Tensor
    logits: torch.Tensor
    orders: LinearOrders
    fused: Mapping[str, int] = field(default_factory=dict)  # module path -> width of the engine GEMM it is part of,
    # for a linear whose siblings another graph holds (a graph break between them): see fused_linear_widths
    kv_tiles: torch.Tensor | None = None  # [B, T, N, 4] int32: each row's split-KV parts and tiles (attention_tiles.py)
    gdn: torch.Tensor | None = None  # [B, T] int32: each row's GatedDeltaNet piece (RowPlan.gdn; padding GDN_NONE)
    body_at: torch.Tensor | None = None  # [B, T] int32: each row's index in its engine forward (RowPlan.body_at; None: 0s)
    logits_at: torch.Tensor | None = None  # [B, T] int32: each row's index in its logits call (RowPlan.logits_at)

    @classmethod
    def of(cls, plans: Sequence[RowPlan], orders: LinearOrders, length: int | None = None,
           fused: Mapping[str, int] | None = None) -> EngineRows:  # fmt: skip
        """The plans of a batch, each padded with 0 to ``length`` (default: the longest): right-padded sequences."""
        width = length if length is not None else max(len(p.body) for p in plans)
        if any(len(p.body) > width for p in plans):
            raise PrecisionError(f"engine rows: a row plan is longer than the batch's {width} positions")
        body = torch.zeros(len(plans), width, dtype=torch.int32)
        logits = torch.zeros(len(plans), width, dtype=torch.int32)
        parts = max((len(row) for p in plans for row in p.kv_tiles or ()), default=0)
        kv_tiles = tiles_tensor([ONE_TILE], parts).repeat(len(plans), width, 1, 1) if parts else None  # padding: one tile
        with_gdn = [p.gdn is not None for p in plans]
        if any(with_gdn) and not all(with_gdn):
            raise PrecisionError("engine rows: some sequences of the batch hold a GatedDeltaNet plan and others none; plan them alike")
        gdn = torch.full((len(plans), width), GDN_NONE, dtype=torch.int32) if plans and all(with_gdn) else None
        body_at = torch.zeros(len(plans), width, dtype=torch.int32)
        logits_at = torch.zeros(len(plans), width, dtype=torch.int32)
        for i, p in enumerate(plans):
            b, lg = p.tensors()
            body[i, : b.shape[1]] = b[0]
            logits[i, : lg.shape[1]] = lg[0]
            b_at, lg_at = p.at_tensors()
            body_at[i, : b_at.shape[1]] = b_at[0]
            logits_at[i, : lg_at.shape[1]] = lg_at[0]
            if kv_tiles is not None and p.kv_tiles is not None:
                kv_tiles[i, : len(p.kv_tiles)] = tiles_tensor(p.kv_tiles, parts)
            if gdn is not None and p.gdn is not None:
                gdn[i, : len(p.gdn)] = torch.tensor(p.gdn, dtype=torch.int32)
        return cls(body, logits, orders, dict(fused or {}), kv_tiles, gdn, body_at, logits_at)

    @functools.cached_property
    def body_groups(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """The body plan's engine-call sizes in increasing order, each with the flat indices of its rows: what
        ``fxp_engine.linear`` splits a batch by, worked out once per batch, not once per linear."""
        return _groups(self.body)

    @functools.cached_property
    def logits_groups(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """``body_groups`` of the logits plan."""
        return _groups(self.logits)


def _groups(plan: torch.Tensor) -> tuple[tuple[int, torch.Tensor], ...]:
    flat = plan.reshape(-1)
    return tuple((int(c), (flat == c).nonzero().flatten()) for c in flat.unique().tolist())


@dataclass
class ContractForward:
    """One forward under the contract: its row plan, and the residual sums its graphs hand on across a graph break
    (``fxp_engine.residual_add`` keeps one, the next graph's ``unrounded_residual`` takes it); dropped when it ends."""

    rows: EngineRows
    residual_sums: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[ContractForward | None] = contextvars.ContextVar("fxp_contract_forward", default=None)


@contextlib.contextmanager
def engine_rows(rows: EngineRows) -> Iterator[None]:
    """Within the block, ``fxp_engine.linear`` computes each row in the order of the engine call that computed it, and
    the residual stream's unrounded sums live for the block (a ContractForward)."""
    token = _ACTIVE.set(ContractForward(rows))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rows() -> EngineRows | None:
    forward = _ACTIVE.get()
    return forward.rows if forward is not None else None


def active_forward() -> ContractForward | None:
    """The forward ``engine_rows`` opened, or None outside one."""
    return _ACTIVE.get()


def attention_calls(sequences: Sequence[TokenSequence], steps: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, int], ...]]:
    """Each engine step's attention call as the requests it held: (query rows, keys) per request, in the step's order
    (``step_requests``); distinct calls only."""
    return list(dict.fromkeys(tuple(requests) for requests in step_requests(sequences, steps) if requests))
