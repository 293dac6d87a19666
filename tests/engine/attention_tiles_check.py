"""vLLM's CPU attention op against the contract's kernel on calls that cross KV tiles and split-KV parts, in a fresh
process at THREADS engine threads (a vLLM engine started in a process fixes torch's thread count there, so the
test runs this on its own): ``python attention_tiles_check.py THREADS SPLIT_KV`` prints one JSON object, the rows
that part per request under the contract's tiles (random and ramped requests: contract/probing.py), the rows the
one-pass kernel parts on each kind, the most parts a row had, and over MERGE_CALLS calls of a decode row whose keys
split (split-KV on), the rows that part under the build's merge (fused, or multiply then add: cpu_family's
``attention_merge_fused``) and under the other form: a split row's bits part by the merge's form now and then only."""

from __future__ import annotations

import json
import sys

import torch

threads, split_kv = int(sys.argv[1]), sys.argv[2] == "on"
torch.set_num_threads(threads)  # the scheduler and the executor read this process's OpenMP threads

from dataclasses import replace  # noqa: E402

from fx_precision.contract.attention_tiles import KvTiling  # noqa: E402
from fx_precision.contract.probing import _contract_attention, _ramped_requests, _requests, call_tiles, match_attention  # noqa: E402
from fx_precision.engines.vllm.cpu_family import attention_merge_fused, engine_kernel_build  # noqa: E402
from fx_precision.engines.vllm.probes import engine_attention_batch  # noqa: E402

HEADS, KV_HEADS, DIM = 16, 8, 128  # Qwen3-0.6B's attention
CALLS = [
    [(1500, 1500)],  # one long prefill: query tiles of the L2's size, each row's keys in several KV tiles
    [(600, 600), (200, 800)],  # two prefills, the second a chunk after 600 cached keys
    [(1, 3000), (1, 500)],  # decodes: the long one splits across threads with split-KV on
    [(300, 300), (1, 1500), (1, 3000)],  # a prefill with decodes: the decode rows change how the prefill is cut
]
MERGE_CALL, MERGE_CALLS = [(1, 600), (1, 100)], 600  # the long decode splits with split-KV on (its bits part by the form on ~2 %)
isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"  # the engine's own pick at bf16, block size 128
l2 = int(torch.cpu.get_capabilities().get("l2_cache_size") or 0)
assert torch.get_num_threads() == threads and l2 > 0, (torch.get_num_threads(), l2)
tiling = KvTiling(isa, l2, DIM, HEADS, KV_HEADS, threads, split_kv)
# the probe's lengths cross KV tiles where the L2 is small (512 KiB on Zen 3: 333 keys are two tiles), as the rollout's
merge_fma = attention_merge_fused(engine_kernel_build())
arith, found = match_attention(lambda r: engine_attention_batch(isa, 128, r, DIM**-0.5, split_kv), HEADS, KV_HEADS, DIM,
                               torch.Generator().manual_seed(0), tiling, merge_fma)  # fmt: skip
assert arith is not None, found
gen = torch.Generator().manual_seed(1)
tiled, one_pass, parts = [], {"random": 0, "ramped": 0}, 0
for shape in CALLS:
    for kind, make in (("random", _requests), ("ramped", _ramped_requests)):
        requests = make(shape, HEADS, KV_HEADS, DIM, gen)
        got = engine_attention_batch(isa, 128, requests, DIM**-0.5, split_kv)
        for (q, k, v), want, tiles in zip(requests, got, call_tiles(tiling, shape), strict=True):
            parts = max(parts, int(tiles.shape[2]) if tiles is not None else 1)
            tiled.append(int((_contract_attention(arith, q, k, v, DIM**-0.5, tiles) != want).any(-1).any(-1).sum()))
            one_pass[kind] += int((_contract_attention(arith, q, k, v, DIM**-0.5) != want).any(-1).any(-1).sum())
merge = {"kept": 0, "other": 0}
other = replace(arith, merge_fma=not merge_fma)
for _ in range(MERGE_CALLS if split_kv else 0):
    requests = _requests(MERGE_CALL, HEADS, KV_HEADS, DIM, gen)
    got = engine_attention_batch(isa, 128, requests, DIM**-0.5, split_kv)
    for (q, k, v), want, tiles in zip(requests, got, call_tiles(tiling, MERGE_CALL), strict=True):
        for name, form in (("kept", arith), ("other", other)):
            merge[name] += int((_contract_attention(form, q, k, v, DIM**-0.5, tiles) != want).any(-1).any(-1).sum())
print(json.dumps({"tiled": tiled, "one_pass": one_pass, "parts": parts, "merge": merge, "arithmetic": arith.describe()}))
