"""oneDNN's GEMVs for a 1-wide linear (the ``gemv16`` and ``gemv16-hadd`` families, contract/linear_order.py): each
kernel is its description.

One register of 16 fp32 lanes from +0; K in blocks of 32, lane j the pair (2j, 2j+1) of each block, its odd product
added and then its even one, each add rounded and flushed to zero if denormal (denormal inputs count as 0, the
products are exact and not flushed); the lanes reduced 16 -> 8 -> 4, then (t0 + t1) + (t2 + t3); the sum flushed if
denormal, then rounded to bf16 nearest-even. Here in fp32 torch ops, one add at a time, on sums that cancel (where
orders part) and on tiny values (where the flushes decide).
"""

from __future__ import annotations

import pytest
import torch

from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.linear_order import LinearKernel, LinearOrder, candidate_orders

TINY = torch.finfo(torch.float32).tiny


def _ftz(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v.abs() < TINY, torch.zeros_like(v) * v.sign(), v)


def _lanes(x: torch.Tensor, w: torch.Tensor, flush: bool) -> torch.Tensor:
    """The 16 lanes both GEMVs fold, [M, 16]: lane j the pair (2j, 2j+1) of each 32-element block, odd product then even,
    each add flushed to zero if denormal where ``flush`` (the hardware VDPBF16PS; the emulated one flushes nothing)."""
    f = _ftz if flush else (lambda v: v)
    m, k = x.shape
    padded = -(-k // 32) * 32
    xs, ws = torch.zeros(m, padded), torch.zeros(padded)
    xs[:, :k], ws[:k] = f(x.float()), f(w.float()[0])
    lanes = torch.zeros(m, 16)
    for k0 in range(0, padded, 32):
        even, odd = k0 + 2 * torch.arange(16), k0 + 2 * torch.arange(16) + 1
        lanes = f(lanes + xs[:, odd] * ws[odd])
        lanes = f(lanes + xs[:, even] * ws[even])
    return lanes


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [1, K] bf16 -> [M, 1] bf16, one fp32 add at a time (module docstring)."""
    lanes = _lanes(x, w, flush=True)
    u = lanes[:, :8] + lanes[:, 8:]
    t = u[:, :4] + u[:, 4:]
    total = (t[:, 0] + t[:, 1]) + (t[:, 2] + t[:, 3])
    return _ftz(total).to(torch.bfloat16).unsqueeze(1)


@pytest.mark.parametrize("k", [16, 33, 128, 2048, 3000])
def test_the_gemv_kernel_is_its_description_on_cancelling_and_tiny_sums(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    half = torch.randn(40, k // 2, generator=g) * torch.exp2(torch.randint(-12, 12, (40, k // 2), generator=g).float())
    x = torch.cat([half, -half, torch.randn(40, k - 2 * (k // 2), generator=g)], dim=1)  # products cancel but for rounding
    x = torch.cat([x, torch.randn(24, k, generator=g) * 1e-20]).to(torch.bfloat16)  # tiny sums: the flushes decide
    w = (1 + torch.rand(1, k, generator=g)).to(torch.bfloat16)
    order = LinearOrder.sequential(k, LinearKernel.GEMV16)
    got = engine_kernels().linear(x, w, None, order.struct())
    assert torch.equal(got.view(torch.int16), _reference(x, w).view(torch.int16))


def _hadd_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The jit GEMV without AVX512-BF16 (``gemv16-hadd``): the same lanes, nothing flushed, the lanes reduced 16 -> 8 and
    then by horizontal adds, ((u0 + u1) + (u2 + u3)) + ((u4 + u5) + (u6 + u7)), the bias last."""
    lanes = _lanes(x, w, flush=False)
    u = lanes[:, :8] + lanes[:, 8:]
    total = ((u[:, 0] + u[:, 1]) + (u[:, 2] + u[:, 3])) + ((u[:, 4] + u[:, 5]) + (u[:, 6] + u[:, 7]))
    return (total if bias is None else total + bias[0]).to(torch.bfloat16).unsqueeze(1)


@pytest.mark.parametrize("k", [16, 33, 96, 2048, 3000])
def test_the_jit_gemv_kernel_is_its_description_and_parts_from_the_brgemv(k: int) -> None:
    """On sums that cancel but for their rounding the two GEMV trees part, and each kernel gives its own."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(1, k, generator=g).to(torch.bfloat16)
    x = torch.randn(300, k, generator=g).to(torch.bfloat16)
    perm = torch.randperm(k, generator=g)
    a, b = perm[: k // 2], perm[k // 2 : 2 * (k // 2)]
    x[:, b] = (-(x[:, a].float() * w[0, a].float()) / w[0, b].float() * (1 + 1e-3 * torch.randn(300, k // 2, generator=g))).to(
        torch.bfloat16
    )
    hadd = {}
    for bias in (None, torch.tensor([0.01])):
        hadd[bias is None] = engine_kernels().linear(x, w, bias, LinearOrder.sequential(k, LinearKernel.GEMV16_HADD).struct())
        assert torch.equal(hadd[bias is None].view(torch.int16), _hadd_reference(x, w, bias).view(torch.int16))
    brgemv = engine_kernels().linear(x, w, None, LinearOrder.sequential(k, LinearKernel.GEMV16).struct())
    if k >= 96:  # enough lanes for the trees to part somewhere in 300 cancelling rows
        assert not torch.equal(brgemv.view(torch.int16), hadd[True].view(torch.int16))


def test_the_gemv_family_is_one_order_and_refuses_another_lane_count() -> None:
    assert candidate_orders(256, 2, LinearKernel.GEMV16) == [LinearOrder.sequential(256, LinearKernel.GEMV16)]
    assert "1-wide GEMV" in LinearOrder.sequential(64, LinearKernel.GEMV16).describe()
    with pytest.raises(Exception, match="gemv16 kernel is one block of all of K, bias last, 16 lanes"):
        LinearOrder(LinearKernel.GEMV16, (1,), (1,), False, 8)
