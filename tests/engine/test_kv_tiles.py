"""The contract's attention against vLLM's own CPU attention op where the engine takes a row's keys in several KV
tiles and split-KV parts (the engine environment).

vLLM's scheduler places its tiles by the L2 size, the step's requests and its threads, and with split-KV on cuts a
long decode row's keys across threads and merges the parts (contract/attention_tiles.py). Calls as a scheduler step
makes them (long prefills that cross query and KV tiles, prefills with decodes, decodes long enough to split), on 1
and 2 engine threads, split-KV off and on: every row of every call is the engine's bits under the contract's tiles,
and the one-pass kernel parts somewhere (so the tiles are what makes them equal).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fx_precision.contract.attention_tiles import KvTiling
from fx_precision.contract.probing import _contract_attention, _requests, call_tiles, match_attention
from fx_precision.engines.vllm.probes import engine_attention_batch

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-0.6B's attention
CALLS = [
    [(1500, 1500)],  # one long prefill: query tiles of the L2's size, each row's keys in several KV tiles
    [(600, 600), (200, 800)],  # two prefills, the second a chunk after 600 cached keys
    [(1, 3000), (1, 500)],  # decodes: the long one splits across threads with split-KV on
    [(300, 300), (1, 1500), (1, 3000)],  # a prefill with decodes: the decode rows change how the prefill is cut
]


def _isa() -> str:
    return "amx" if torch.cpu._is_amx_tile_supported() else "vec"  # the engine's own pick at bf16, block size 128


@pytest.fixture(scope="module")
def arithmetic() -> Iterator[object]:
    run = lambda requests: engine_attention_batch(_isa(), 128, requests, DIM**-0.5, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        arith, found = match_attention(run, HEADS, KV_HEADS, DIM, torch.Generator().manual_seed(0))
    finally:
        torch.set_num_threads(threads)
    assert arith is not None, found
    yield arith


@pytest.mark.parametrize(("threads", "split_kv"), [(1, False), (2, False), (2, True)], ids=["1-thread", "2-threads", "2-threads-split-kv"])
def test_every_row_is_the_engines_bits_in_its_tiles_and_parts(arithmetic: object, threads: int, split_kv: bool) -> None:
    l2 = int(torch.cpu.get_capabilities().get("l2_cache_size") or 0)
    assert l2 > 0, "torch reports no L2 size: the engine would size its tiles from 0"
    tiling = KvTiling(_isa(), l2, DIM, HEADS, KV_HEADS, threads, split_kv)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the scheduler and executor read the calling process's OpenMP threads
    gen = torch.Generator().manual_seed(1)
    tiled, one_pass, parts = [], 0, 0
    try:
        for shape in CALLS:
            requests = _requests(shape, HEADS, KV_HEADS, DIM, gen)
            got = engine_attention_batch(_isa(), 128, requests, DIM**-0.5, split_kv)
            for (q, k, v), want, tiles in zip(requests, got, call_tiles(tiling, shape), strict=True):
                parts = max(parts, int(tiles.shape[2]) if tiles is not None else 1)
                ours = _contract_attention(arithmetic, q, k, v, DIM**-0.5, tiles)  # type: ignore[arg-type]
                tiled.append(int((ours != want).any(-1).any(-1).sum()))
                one_pass += int((_contract_attention(arithmetic, q, k, v, DIM**-0.5) != want).any(-1).any(-1).sum())  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before)
    assert sum(tiled) == 0, f"rows that part under the contract's tiles, per request: {tiled}"
    assert one_pass > 0, "the one-pass kernel gave every row too: these calls do not exercise the tiles"
    assert (parts > 1) == split_kv, f"split-KV parts per row at most {parts}"
