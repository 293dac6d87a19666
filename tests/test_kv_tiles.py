"""The engine's KV tiles and split-KV parts without an engine: where vLLM's CPU attention scheduler places them
(contract/attention_tiles.py), the contract kernel's online softmax across them against a scalar reference written
from the kernel's own description, and the row plans that carry them into a training forward. The live engine's
bits are tests/engine/test_kv_tiles.py's."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import struct
from types import SimpleNamespace

import pytest
import torch

from fx_precision.contract import EngineContract, contract_notes
from fx_precision.contract.attention_tiles import NO_END, ONE_TILE, KvTiling, longest_row, smallest_kv_tile
from fx_precision.contract.batch_rows import EngineRows, RowPlan, engine_rows, row_plans, step_requests
from fx_precision.contract.kernels import attention_variant, engine_kernels
from fx_precision.contract.ops import engine_attention
from fx_precision.engine_description import EngineDescription
from fx_precision.errors import PrecisionError

ZEN4 = KvTiling("vec", 1 << 20, 128, 16, 8, 1, False)  # a 2-core Zen 4: L2 1 MiB, Qwen3-0.6B's heads, one engine thread
LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
LIBM.expf.restype, LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]
LIBM.fmaf.restype, LIBM.fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
VARIANT = {"scores": "vec", "exp": "libm", "lane_sum": "avx512", "p_bf16": False, "fma": True, "store": "nearest-even"}


def test_one_thread_tiles_are_query_tiles_from_each_requests_first_row() -> None:
    """One engine thread: each request one workitem; query tiles of 328 rows from its first row (1 MiB L2, head_dim
    128), the KV tiles sized by each query tile's rows: 320 keys for a full tile, 800 for the 72-row rest of 400."""
    rows = ZEN4.query_row_tiles([(400, 400)])[0]
    assert rows[0] == rows[327] == ((0, NO_END, 0, 320),)
    assert rows[328] == rows[399] == ((0, NO_END, 0, 800),)
    decode = ZEN4.query_row_tiles([(1, 900), (64, 64)])
    assert decode[0] == [((0, NO_END, 0, 16128),)]  # a decode row: a one-row query tile, one tile of 16128 keys
    assert smallest_kv_tile("vec", 1 << 20, 128) == 320 and smallest_kv_tile("amx", 2 << 20, 128) == 736


def test_the_engines_threads_cut_workitems_and_restart_query_tiles() -> None:
    """16 engine threads cut a 400-row prefill into workitems by each thread's share of the keys (0, 96, 144, 176,
    208, ...): every query tile is short, so its KV tiles are long, and no row spans two."""
    tiling = KvTiling("vec", 1 << 20, 128, 16, 8, 16, False)
    items = tiling.workitems([(400, 400)])
    assert [w.first for w in items][:5] == [0, 96, 144, 176, 208] and items[-1].first == 392
    rows = tiling.query_row_tiles([(400, 400)])[0]
    assert all(len(r) == 1 and r[0][3] >= position + 1 for position, r in enumerate(rows))
    with_decode = KvTiling("vec", 1 << 20, 128, 16, 8, 16, False).workitems([(2048, 2048), (1, 900)])
    alone = KvTiling("vec", 1 << 20, 128, 16, 8, 16, False).workitems([(2048, 2048)])
    assert [w.first for w in with_decode][:5] != [w.first for w in alone][:5]  # a decode row in the step moves the cuts


def test_split_kv_cuts_a_long_decode_row_into_parts_in_key_order() -> None:
    """Split-KV on 4 threads: the 20000-key decode row is cut at 4320, 9568 and 14816 keys; each part its own
    workitem (tiles from its first key), the last running to the row's end. Off, it is one part."""
    split = KvTiling("vec", 1 << 20, 128, 16, 8, 4, True).query_row_tiles([(1, 900), (1, 20000)])
    assert split[0] == [((0, NO_END, 0, 16128),)]
    assert [p[:2] for p in split[1][0]] == [(0, 4320), (4320, 9568), (9568, 14816), (14816, NO_END)]
    assert [p[2] for p in split[1][0]] == [0, 4320, 9568, 14816]
    whole = KvTiling("vec", 1 << 20, 128, 16, 8, 4, False).query_row_tiles([(1, 900), (1, 20000)])
    assert whole[1] == [((0, NO_END, 0, 16128),)]


def test_a_tiling_is_typed_and_round_trips_in_the_contract() -> None:
    contract = EngineContract(kv_tiling=ZEN4)
    data = json.loads(json.dumps(contract.to_dict()))
    assert EngineContract.from_dict(data) == contract and "1024 KiB L2" in contract.describe()
    older = {k: v for k, v in data.items() if k != "kv_tiling"}  # written before tiles were followed: one tile per row
    assert EngineContract.from_dict(older).kv_tiling is None
    with pytest.raises(PrecisionError, match=r"contract\.kv_tiling\.threads=0: a positive integer"):
        EngineContract.from_dict({**data, "kv_tiling": {**data["kv_tiling"], "threads": 0}})
    with pytest.raises(PrecisionError, match=r"KvTiling\.isa='vec16'"):
        KvTiling("vec16", 1 << 20, 128, 16, 8, 1, False)
    assert KvTiling.of_engine(EngineDescription(attention_isa="vec16", l2_cache_bytes=1 << 20, head_dim=128), 16, 8) is None


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _bf16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float())


def _reference_row(q: list[float], keys: list[list[float]], values: list[list[float]], scale: float,
                   parts: tuple[tuple[int, int, int, int], ...], merge_fma: bool = True) -> list[float]:  # fmt: skip
    """One causal row over ``keys`` (all of them its own) as attention_kernels.cpp's comment describes vec attention
    (fma scores, glibc expf, the AVX-512 lane reduction, fp32 P, fused P.V, a nearest-even store), with KV tiles and
    split-KV parts, the tiles' rescale and the parts' merge fused or (``merge_fma`` False, vLLM's AVX2 build)
    multiplied then added: a scalar transcription, float32 rounding after every operation (double rounding of one
    add, multiply or divide of floats is exact)."""

    def fused(a: float, b: float, c: float) -> float:  # a * b + c as the build computes it
        return float(LIBM.fmaf(a, b, c)) if merge_fma else _f32(_f32(a * b) + c)

    scale32 = _f32(scale)
    qs = [_f32(x * scale32) for x in q]
    scores = []
    for k in keys:
        a = 0.0
        for x, y in zip(qs, k, strict=True):
            a = LIBM.fmaf(x, y, a)
        scores.append(a)
    merged = None
    for start, end, origin, tile in parts:
        lo, hi = start, min(len(keys), end) - 1
        m, total, acc, first_tile = -3.4028234663852886e38, 0.0, [0.0] * len(q), True
        j = lo
        while j <= hi:
            index = (j - origin) // tile if tile else 0
            last = min(hi, origin + (index + 1) * tile - 1) if tile else hi
            tile_max = max([m, *scores[j : last + 1]])
            shift = _f32(m - tile_max)
            rescale = shift < -8.0
            mu = tile_max if rescale else m
            lane = [0.0] * 16
            e = {}
            for i in range(j, last + 1):
                e[i] = LIBM.expf(_f32(scores[i] - mu))
                lane[i % 16] = _f32(lane[i % 16] + e[i])
            s8 = [_f32(lane[i + 8] + lane[i]) for i in range(8)]
            s4 = [_f32(s8[i + 4] + s8[i]) for i in range(4)]
            tile_sum = _f32(_f32(s4[0] + s4[2]) + _f32(s4[1] + s4[3]))
            if rescale:
                f = LIBM.expf(shift)
                total = fused(f, total, tile_sum)
                acc = acc if first_tile else [_f32(a * f) for a in acc]
                m = tile_max
            else:
                total = _f32(tile_sum + total)
            for i in range(j, last + 1):
                acc = [LIBM.fmaf(e[i], v, a) for a, v in zip(acc, values[i], strict=True)]
            first_tile, j = False, last + 1
        if merged is None:
            merged = (m, total, acc)
            continue
        big_m, big_l, big_o = merged
        if big_m > m:
            f = LIBM.expf(_f32(m - big_m))
            merged = (big_m, fused(total, f, big_l), [fused(a, f, o) for a, o in zip(acc, big_o, strict=True)])
        else:
            f = LIBM.expf(_f32(big_m - m))
            merged = (m, fused(big_l, f, total), [fused(o, f, a) for a, o in zip(acc, big_o, strict=True)])
    assert merged is not None
    inv = _f32(1.0 / merged[1])
    return [_bf16(_f32(inv * a)) for a in merged[2]]


@pytest.mark.parametrize("parts", [
    ((0, NO_END, 0, 0),),  # one tile: the one-pass softmax
    ((0, NO_END, 0, 32),),  # tiles of 32 keys: the rescale and the lazy max between them
    ((0, 64, 0, 32), (64, NO_END, 64, 32)),  # two split-KV parts, merged
    ((0, 32, 0, 0), (32, 96, 32, 32), (96, NO_END, 96, 0)),  # three, the middle one in two tiles
], ids=["one-tile", "tiles", "two-parts", "three-parts"])  # fmt: skip
@pytest.mark.parametrize("merge_fma", [True, False], ids=["fused-merge", "mul-add-merge"])
def test_the_kernels_online_softmax_is_its_description_bit_for_bit(parts: tuple[tuple[int, int, int, int], ...], merge_fma: bool) -> None:
    """Rows over 120 keys whose scores jump by more than 8 in one tile (a rescale) and by less in another (the lazy
    max): the kernel's output is the scalar transcription's for every head dim of the rows checked, with the tiles'
    rescale and the parts' merge fused (the AVX-512 builds) or multiplied then added (vLLM's AVX2 build, which vLLM
    does not contract to FMA there); tiles and parts change some rows' bits (they move fp32 sums by an ulp or so, which a bf16
    store shows now and then: 2048 rows, each seeing every key), and so does the merge's form where a row has parts
    or a rescale."""
    gen = torch.Generator().manual_seed(3)
    S, D, T = 120, 32, 2048
    k = torch.randn(1, S, 1, D, generator=gen)
    k[:, 40:50] *= 4  # scores well above the first tile's max
    k[:, 70:80] *= 2
    q = (torch.randn(1, T, 1, D, generator=gen) * 2).to(torch.bfloat16)
    k, v = k.to(torch.bfloat16), torch.randn(1, S, 1, D, generator=gen).to(torch.bfloat16)
    tiles = torch.tensor(list(parts), dtype=torch.int32).repeat(1, T, 1, 1)
    variant = attention_variant(**VARIANT, merge_fma=merge_fma)
    got = engine_kernels().attention(q, k, v, torch.tensor([S]), None, D**-0.5, False, -1, 0, variant, kv_tiles=tiles)
    keys, values = k[0, :, 0].float().tolist(), v[0, :, 0].float().tolist()
    for t in range(4):
        want = _reference_row(q[0, t, 0].float().tolist(), keys, values, D**-0.5, parts, merge_fma)
        assert got[0, t, 0].float().tolist() == want, t
    one_pass = engine_kernels().attention(q, k, v, torch.tensor([S]), None, D**-0.5, False, -1, 0, variant)
    assert torch.equal(got, one_pass) == (parts == ONE_TILE)


def test_the_merges_form_shows_in_the_rows_it_parts_and_each_is_its_description() -> None:
    """Split-KV parts merged fused (the AVX-512 builds) and multiplied then added (vLLM's AVX2 build): the two part
    some rows' bits (an fp32 ulp that the bf16 store shows now and then: 4096 rows of 64 dims), and on those rows
    each form is its scalar transcription."""
    gen = torch.Generator().manual_seed(5)
    S, D, T = 120, 64, 4096
    parts = ((0, 64, 0, 0), (64, NO_END, 64, 0))
    k, v = (torch.randn(1, S, 1, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(1, T, 1, D, generator=gen) * 2).to(torch.bfloat16)
    tiles = torch.tensor(list(parts), dtype=torch.int32).repeat(1, T, 1, 1)
    out = {fused: engine_kernels().attention(q, k, v, torch.tensor([S]), None, D**-0.5, False, -1, 0,
                                             attention_variant(**VARIANT, merge_fma=fused), kv_tiles=tiles)
           for fused in (True, False)}  # fmt: skip
    parted = (out[True] != out[False]).flatten(2).any(-1)[0].nonzero().flatten().tolist()
    assert parted, "the merge's two forms gave the same bits on every row"
    keys, values = k[0, :, 0].float().tolist(), v[0, :, 0].float().tolist()
    for t in parted[:2]:
        for fused in (True, False):
            want = _reference_row(q[0, t, 0].float().tolist(), keys, values, D**-0.5, parts, fused)
            assert out[fused][0, t, 0].float().tolist() == want, (t, fused)


@pytest.mark.parametrize("variant", [
    VARIANT,
    {**VARIANT, "exp": "fast512", "fma": False},
    {**VARIANT, "exp": "fast512", "lane_sum": "avx2", "p_bf16": True, "store": "truncate"},
], ids=["libm-fma", "fast512-mul-add", "fast512-pbf16-avx2-truncate"])  # fmt: skip
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_the_vector_attention_is_the_scalar_one_bit_for_bit(variant: dict[str, object], head_dim: int) -> None:
    """The vec variant's vector paths (16 or 8 keys, or head dims, to a vector) give the scalar loop's bits on every
    row: GQA, a padded batch, a causal and a sliding-window mask and a boolean one with holes, one tile and KV tiles
    with split-KV parts; on this CPU's best path, AVX-512F and AVX2 (its dot sequences 8 lanes wide; a path this CPU
    lacks falls to the next it has)."""
    gen = torch.Generator().manual_seed(head_dim)
    B, S, H, KVH = 2, 150, 4, 2
    q = (torch.randn(B, S, H, head_dim, generator=gen) * 2).to(torch.bfloat16)
    k = torch.randn(B, S, KVH, head_dim, generator=gen)
    k[:, 40:50] *= 4
    k, v = k.to(torch.bfloat16), torch.randn(B, S, KVH, head_dim, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([S, 97])
    holes = torch.rand(B, 1, S, S, generator=gen) > 0.3
    tiles = torch.tensor([(0, 64, 0, 32), (64, NO_END, 70, 32)], dtype=torch.int32).repeat(B, S, 1, 1)
    calls = [((None, True, -1), None), ((None, True, 20), None), ((holes, False, -1), None), ((None, True, -1), tiles)]
    kernels, struct_ = engine_kernels(), attention_variant(**variant)  # type: ignore[arg-type]
    try:
        for (mask, causal, window), kv_tiles in calls:
            outs = []
            for path in kernels.VECTOR_PATHS:  # best, avx512f, avx2, scalar
                kernels.set_vector_path(path)
                outs.append(kernels.attention(q, k, v, lens, mask, head_dim**-0.5, causal, window, 0, struct_, kv_tiles=kv_tiles))
            assert all(torch.equal(out, outs[-1]) for out in outs[:-1]), (causal, window, kv_tiles is not None)
    finally:
        kernels.set_vector_path("best")


def test_rows_that_fit_one_tile_are_the_one_pass_kernels_and_the_forwards_tiles_are_read() -> None:
    """Tiles a row does not reach change nothing (any batch, GQA, every row); inside ``engine_rows`` the op reads the
    forward's tiles, and a plan for another shape is refused in one line."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 256, 4, 64, generator=gen) * 2).to(torch.bfloat16)
    k, v = (torch.randn(2, 256, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([256, 200])
    args = (q, k, v, lens, None, 0.125, True, -1, 0, "vec", "fast512", "avx512", False, True, "nearest-even")
    one_pass = engine_attention(*args)
    wide = torch.tensor([0, NO_END, 0, 256], dtype=torch.int32).repeat(2, 256, 1, 1)
    assert torch.equal(engine_attention(*args, kv_tiles=wide), one_pass)
    narrow = torch.tensor([0, NO_END, 0, 32], dtype=torch.int32).repeat(2, 256, 1, 1)
    tiled = engine_attention(*args, kv_tiles=narrow)
    assert torch.equal(tiled[:, :32], one_pass[:, :32]) and not torch.equal(tiled, one_pass)
    plan = RowPlan((256,) * 256, (0,) * 255, (((0, NO_END, 0, 32),),) * 256)
    rows = EngineRows.of([plan, plan], SimpleNamespace())  # type: ignore[arg-type]
    with engine_rows(rows):
        assert torch.equal(engine_attention(*args), tiled)
        with pytest.raises(PrecisionError, match=r"KV tiles are planned for \(2, 256\) rows.*set engine_rows"):
            engine_attention(q[:, :8], *args[1:])
    with pytest.raises(PrecisionError, match=r"kv_tiles must be \[B, T, N, 4\]"):
        engine_attention(*args, kv_tiles=narrow[..., :2])


def test_row_plans_carry_each_rows_tiles_from_the_step_that_computed_it() -> None:
    """A prompt of 400 prefilled in one step with a second of 5, then decode steps: the prompt's rows take the query
    tiles of their request in that step, the decode rows one tile each; a padded batch pads with one tile."""
    long = SimpleNamespace(tokens=[7] * 400 + [1, 2], prompt_len=400)
    short = SimpleNamespace(tokens=[3] * 5 + [4, 5], prompt_len=5)
    steps = [[(p, 7) for p in range(400)] + [(p, 3) for p in range(5)], [(400, 1), (5, 4)], [(401, 2), (6, 5)]]
    engine = {"steps": steps, "logits_calls": [[0, 399], [0, 4], [0, 2], [1, 2], [2, 2]]}
    plans = row_plans([long, short], engine, tiling=ZEN4)
    assert plans[0].kv_tiles is not None and plans[1].kv_tiles is not None
    assert plans[0].kv_tiles[0] == plans[0].kv_tiles[327] == ((0, NO_END, 0, 320),)
    assert plans[0].kv_tiles[328] == ((0, NO_END, 0, 800),) and plans[0].kv_tiles[400] == ((0, NO_END, 0, 16128),)
    assert plans[1].kv_tiles[0] == ((0, NO_END, 0, 16128),)  # 5 rows: one query tile of 8, long KV tiles
    assert row_plans([long, short], engine)[0].kv_tiles is None  # no tiling recorded: one tile per row
    rows = EngineRows.of(plans, SimpleNamespace(), length=402)  # type: ignore[arg-type]
    assert rows.kv_tiles is not None and tuple(rows.kv_tiles.shape) == (2, 402, 1, 4)
    assert rows.kv_tiles[1, 10].tolist() == [list(ONE_TILE[0])]  # past the short sequence: one tile


def test_a_steps_requests_are_its_runs_that_one_sequence_holds() -> None:
    """Rows at consecutive positions belong to one request only where one sequence holds them all: a decode at 4 and
    another request's rows from 5 are two requests."""
    a = SimpleNamespace(tokens=[1, 1, 1, 1, 1, 9], prompt_len=5)
    b = SimpleNamespace(tokens=[2] * 9, prompt_len=9)
    assert step_requests([a, b], [[(4, 1), (5, 2), (6, 2), (7, 2)]]) == [[(1, 5), (3, 8)]]
    assert step_requests([a, b], [[(0, 1), (1, 1), (0, 2), (1, 2)]]) == [[(2, 2), (2, 2)]]


def test_notes_name_long_rows_only_for_a_contract_that_does_not_follow_tiles() -> None:
    """A contract without a tiling (written before tiles were followed) whose run saw more keys than the engine's
    smallest tile is named in the notes; one that follows the tiles is not."""
    record = {"attention_isa": "vec", "l2_cache_bytes": 1 << 20, "head_dim": 128, "steps": [[(p, 1) for p in range(513)]]}
    engine, longest = EngineDescription.of_run(record), longest_row(record)
    untiled = [n for n in contract_notes(EngineContract(), engine, longest) if "KV tile" in n]
    assert len(untiled) == 1 and "up to 513 keys" in untiled[0] and "320 keys at head_dim 128" in untiled[0]
    assert not any("KV tile" in n for n in contract_notes(EngineContract(kv_tiling=ZEN4), engine, longest))
    assert not any("KV tile" in n for n in contract_notes(EngineContract(), engine, longest_row({"steps": [[(p, 1) for p in range(300)]]})))
