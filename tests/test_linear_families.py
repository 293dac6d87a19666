"""The engine's GEMM families without an engine: each kernel the contract runs, against its reference and its oracle,
on every vector path this CPU has, and the probe reading each family off a kernel that sums in it.

    pairs   (oneDNN's AVX-512 BF16 brgemm, its AVX-512 bf16-emulating GEMM, SGL's small-batch kernel)
    lanes   (torch's own bf16 GEMM, where oneDNN refuses bf16: AVX2)
    amx     (oneDNN's AMX brgemm; held in tests/test_engine_contract.py, hardware against emulation)

The live engine run as each CPU family is in tests/engine/test_cpu_families.py.
"""

from __future__ import annotations

import pytest
import torch

from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.linear_order import LinearKernel, LinearOrder, candidate_orders
from fx_precision.contract.probing import block_starts, boundary_rows, linear_families, read_linear_order
from fx_precision.engines.vllm.cpu_family import CpuFamily, family_settings, native_family, runnable_families
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
PAIRS_BLOCKED = LinearOrder(LinearKernel.PAIRS, (128, 128, 128, 116), (2, 2))  # K = 1000 in 4 blocks, 2 parts
ORDERS = {
    "pairs in order": LinearOrder.sequential(1000, LinearKernel.PAIRS),
    "pairs blocked in parts": PAIRS_BLOCKED,
    "pairs from the bias": LinearOrder.sequential(1000, LinearKernel.PAIRS, bias_first=True),
    "lanes": LinearOrder.sequential(1000, LinearKernel.LANES),
}


def _cancelling(rows: int, k: int, out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs on which summation orders part in the last bits: small products plus a huge one that the last element
    cancels exactly (see tests/test_engine_contract.py)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=gen) * 0.1
    x = torch.randn(rows, k, generator=gen)
    w[:, 0] = w[:, -1] = 1.0
    x[:, 0], x[:, -1] = 2.0**14, -(2.0**14)
    return x.to(BF16), w.to(BF16), torch.randn(out, generator=gen).to(BF16)


@pytest.mark.parametrize("name", list(ORDERS))
def test_every_vector_path_gives_the_scalar_reference_on_any_thread_count(name: str) -> None:
    """The pairs and lanes kernels on the CPU's best path, AVX-512F, AVX2 and scalar code (a path this CPU lacks falls
    to the next it has), on 1 and 2 threads, give the bits of the one-output reference the probe folds with, on rows
    and outputs off every tile size; the orders themselves part on these inputs."""
    order = ORDERS[name]
    x, w, b = _cancelling(37, 1000, 80, seed=5)
    kernels = engine_kernels()
    cols = torch.arange(37) % 80
    reference = kernels.product_fold(x, w[cols].contiguous(), b.float()[cols], order.struct())
    try:
        for path in kernels.VECTOR_PATHS:
            kernels.set_vector_path(path)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = kernels.linear(x, w, b, order.struct())
                assert torch.equal(out[torch.arange(37), cols], reference), (name, path, threads)
    finally:
        kernels.set_vector_path("best")
        torch.set_num_threads(1)
    others = [kernels.linear(x, w, b, o.struct()) for n, o in ORDERS.items() if n != name and o.kernel != LinearKernel.LANES]
    assert all(not torch.equal(kernels.linear(x, w, b, order.struct()), other) for other in others)


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch.backends.mkldnn.flags on a CPU build
@pytest.mark.parametrize("k", [1, 15, 16, 17, 63, 64, 65, 100, 1000, 4133])
def test_the_lanes_order_is_torchs_own_bf16_gemm(k: int) -> None:
    """The lanes kernel is what torch.nn.functional.linear computes where oneDNN does not run it (vLLM's fallback on
    AVX2 CPUs): ATen's AVX2 bf16 dot, main loop, vector tail and scalar tail, with and without a bias, one row and
    several, bit for bit against torch itself."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=gen).to(BF16)
    w = torch.randn(40, k, generator=gen).to(BF16)
    bias = (-(x[0].float() @ w.float().T)).to(BF16)  # about -dot: the fp32 sum's rounding shows in the bf16 result
    order = LinearOrder.sequential(k, LinearKernel.LANES).struct()
    with torch.backends.mkldnn.flags(enabled=False):
        for rows in (1, 5):
            for b in (None, bias):
                assert torch.equal(engine_kernels().linear(x[:rows], w, b, order), torch.nn.functional.linear(x[:rows], w, b)), (rows, b)


@pytest.mark.parametrize(
    "order",
    [
        LinearOrder(LinearKernel.PAIRS, (256, 256), (2,)),
        LinearOrder(LinearKernel.PAIRS, tuple([4] * 128), (128,)),
        LinearOrder.sequential(1024, LinearKernel.PAIRS, bias_first=True),
        LinearOrder.sequential(1024, LinearKernel.LANES),
        LinearOrder(LinearKernel.AMX_CHUNKS, (11, 11, 10), (3,)),
    ],
    ids=["pairs-512-blocks", "pairs-8-element-blocks", "small-batch-from-bias", "lanes", "amx-blocks"],
)
def test_the_probe_reads_each_family_off_a_kernel_that_sums_in_it(order: LinearOrder) -> None:
    """An engine call that sums in a known order of any family (the contract's own kernel standing in for the engine's)
    is read back as that order; where this CPU has no AMX tiles the AMX family is not tried, and says so."""
    kernels = engine_kernels()
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 1024, generator=gen) * 0.05).to(BF16)
    bias = torch.randn(96, generator=gen).to(BF16)

    def call(x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, w, bias, order.struct())

    if order.kernel == LinearKernel.AMX_CHUNKS and not kernels.cpu_has_amx():
        _, not_tried = linear_families(1024, 1, True)
        assert "no AMX" in not_tried["amx-chunks"]
        pytest.skip("this CPU has no AMX tiles: the AMX family is not tried here (held above), its read needs an AMX CPU")
    linear, evidence = read_linear_order(call, w, bias, 4, 1, torch.Generator().manual_seed(1))
    found = linear.order if linear is not None else None
    assert found == order.canonical(), (found, evidence)
    assert evidence.kept == order.canonical().describe()


@pytest.mark.parametrize("blocks", [(176,), (175, 1), (88, 88), (172, 4)], ids=["in-order", "one-pair-last", "halves", "four-pairs-last"])
def test_the_probe_tells_a_short_block_at_ks_end_from_k_in_order(blocks: tuple[int, ...]) -> None:
    """Orders that part only where a block starts late in K (a last block of one pair, summed from 0, against K in
    order) give the same bits on nearly every random and targeted probe input; the probe's rows at the block starts
    where its candidates part (probing.boundary_rows) read the order back alone, never two kept as ambiguous."""
    kernels = engine_kernels()
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(160, 352, generator=gen) * 0.02).to(BF16)
    order = LinearOrder(LinearKernel.PAIRS, blocks, (len(blocks),))

    def call(x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, w, None, order.struct())

    read, evidence = read_linear_order(call, w, None, 4, 1, torch.Generator().manual_seed(1))
    assert read is not None and read.order == order.canonical() and not evidence.ambiguous, evidence


@pytest.mark.parametrize("blocks", [(1, 175), (175, 1), (60, 60, 56)], ids=["one-pair-first", "one-pair-last", "thirds"])
def test_boundary_rows_part_every_row_where_no_two_weights_share_a_magnitude(blocks: tuple[int, ...]) -> None:
    """The boundary rows cancel their large product by crossing two weights, not by finding two of one magnitude: on a
    weight whose every row holds 352 distinct magnitudes over 40 binades, every probed output parts a pairs order with
    a block start from K in order, at a start as early as K's second pair."""
    kernels = engine_kernels()
    gen = torch.Generator().manual_seed(5)
    mantissas = 1 + torch.randperm(128, generator=gen)[:9].float() / 128
    magnitudes = torch.stack([mantissas * 2.0**-e for e in range(40)]).flatten()[:352]  # bf16 exactly, each distinct
    w = torch.stack([magnitudes[torch.randperm(352, generator=gen)] for _ in range(24)])
    w = (w * torch.where(torch.rand(24, 352, generator=gen) < 0.5, -1.0, 1.0)).to(BF16)
    assert all(w[r].float().abs().unique().numel() == 352 for r in range(24))
    blocked, in_order = LinearOrder(LinearKernel.PAIRS, blocks, (len(blocks),)), LinearOrder.sequential(352, LinearKernel.PAIRS)
    x, targets = boundary_rows(w, 32, gen, block_starts([blocked, in_order]))
    rows = torch.arange(32)
    got_blocked = kernels.linear(x, w, None, blocked.struct())[rows, targets]
    got_in_order = kernels.linear(x, w, None, in_order.struct())[rows, targets]
    assert bool((got_blocked != got_in_order).all()), (got_blocked, got_in_order)


def test_the_order_families_are_canonical_without_merging_what_sums_otherwise() -> None:
    """A one-pair block is not the previous block's next pair (its adds start from 0), and a one-block third part is
    not the second part's next block (the total adds the second part first); an AMX one-chunk block is the previous
    block's next chunk. The pairs family holds blocks of 512 and 8 elements; lanes has one order."""
    one_pair = LinearOrder(LinearKernel.PAIRS, (511, 1), (2,))
    assert one_pair.canonical() == one_pair
    third = LinearOrder(LinearKernel.AMX_CHUNKS, (4, 4, 4, 4, 1), (2, 2, 1))
    assert third.canonical() == third
    assert LinearOrder(LinearKernel.AMX_CHUNKS, (4, 4, 1), (3,)).canonical() == LinearOrder(LinearKernel.AMX_CHUNKS, (4, 5), (2,))
    family = candidate_orders(2048, 2, LinearKernel.PAIRS)
    assert LinearOrder(LinearKernel.PAIRS, (256,) * 4, (4,)) in family and LinearOrder(LinearKernel.PAIRS, (4,) * 256, (256,)) in family
    assert candidate_orders(2048, 8, LinearKernel.LANES) == [LinearOrder.sequential(2048, LinearKernel.LANES)]
    with pytest.raises(PrecisionError, match="the lanes kernel is one block of all of K"):
        LinearOrder(LinearKernel.LANES, (2,), (1,), lanes=8)


AMX_CPU = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
ZEN4_CPU = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
AVX2_CPU = {"avx2", "fma"}


def test_the_cpu_families_are_read_off_the_flags_and_a_family_the_cpu_lacks_is_refused() -> None:
    """Sapphire Rapids runs every family, a Zen 4 all but AMX, an AVX2 machine only its own; only a narrower family than
    the machine's caps oneDNN; --isa of a family the CPU lacks is one line naming the missing instructions and what this CPU can run as."""
    assert native_family(AMX_CPU) == CpuFamily.AMX and runnable_families(AMX_CPU) == list(CpuFamily)
    assert native_family(ZEN4_CPU) == CpuFamily.AVX512_BF16 and CpuFamily.AMX not in runnable_families(ZEN4_CPU)
    assert runnable_families(AVX2_CPU) == [CpuFamily.AVX2]
    assert family_settings("auto", ZEN4_CPU).family == CpuFamily.AVX512_BF16
    assert family_settings("avx2", AMX_CPU).environment() == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert family_settings("avx512-bf16", AMX_CPU).environment() == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    # the machine's own family caps nothing: the engine runs as its users launch it there
    assert family_settings("auto", ZEN4_CPU).environment() == family_settings("avx512-bf16", ZEN4_CPU).environment() == {}
    assert family_settings("avx2", AVX2_CPU).environment() == family_settings("auto", AMX_CPU).environment() == {}
    with pytest.raises(PrecisionError, match=r"--isa amx: this CPU lacks amx_tile, amx_bf16, so an engine here cannot run as amx; "
                                             r"it can run as avx512-bf16, avx512, avx2"):  # fmt: skip
        family_settings("amx", ZEN4_CPU)
    with pytest.raises(PrecisionError, match="--isa avx512-bf16: this CPU lacks avx512f, avx512_bf16"):
        family_settings("avx512-bf16", AVX2_CPU)
    with pytest.raises(PrecisionError, match="--isa 'sse4': one of auto, amx, avx512-bf16, avx512, avx2"):
        family_settings("sse4", AMX_CPU)


def test_the_probe_reads_a_row_the_engine_summed_apart() -> None:
    """An engine call that sums its middle row in another order than the rest (oneDNN's jit GEMM without AVX512-BF16 on
    two threads: an odd call of 5 or more rows): no one order gives every row, and the probe reads the call's order and
    that row's apart; a call summed one way has nothing apart."""
    kernels = engine_kernels()
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(6, 192, generator=gen) * 0.05).to(BF16)
    main, other = LinearOrder.sequential(192, LinearKernel.PAIRS), LinearOrder(LinearKernel.PAIRS, (4,) * 24, (24,))

    def call(x: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(x, w, None, main.struct())
        middle = (x.shape[0] - 1) // 2
        if x.shape[0] % 2:
            out[middle] = kernels.linear(x[middle : middle + 1].contiguous(), w, None, other.struct())[0]
        return out

    read, evidence = read_linear_order(call, w, None, 7, 2, torch.Generator().manual_seed(1))
    assert read is not None and read.order == main and read.apart == ((3, other),), evidence
    assert evidence.record is not None and evidence.record["apart"] == {"3": other.to_dict()}
    read, evidence = read_linear_order(call, w, None, 6, 2, torch.Generator().manual_seed(1))
    assert read is not None and read.order == main and read.apart == (), evidence

    def every_third(x: torch.Tensor) -> torch.Tensor:  # many rows apart, as a thread split might leave them
        out = kernels.linear(x, w, None, main.struct())
        out[2::3] = kernels.linear(x[2::3].contiguous(), w, None, other.struct())
        return out

    read, evidence = read_linear_order(every_third, w, None, 301, 2, torch.Generator().manual_seed(2))
    assert read is not None and read.order == main and read.apart == tuple((i, other) for i in range(2, 301, 3)), evidence
