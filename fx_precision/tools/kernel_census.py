"""What Inductor generated: kernels, the buffers they read and write, bytes by dtype.

Parsed from the wrapper code Inductor emits (``torch._inductor.utils.run_and_get_code``)::

    buf4 = empty_strided_cpu((2, 8, 32), (256, 32, 1), torch.bfloat16)          allocation: shape, dtype
    cpp_fused_..._0 = async_compile.cpp_pybinding(['float*', 'const int64_t*', …])  signature: dtype, const=read
    cpp_fused_..._0(buf2, primals_2, primals_1, …)                               a generated kernel call
    extern_kernels.mm(reinterpret_tensor(buf4, (16, 32), …), buf3, out=buf5)     an extern call (listed apart)

    KernelCensus
    ├── kernels: [Kernel(name, args: [(buffer, dtype, numel, read|write)])]
    ├── bytes_read / bytes_written by dtype (generated kernels)
    ├── extern: calls and bytes by dtype (matmuls, SDPA: vendor kernels Inductor does not generate),
    │           and MoE expert GEMMs (grouped_mm calls) by the dtype they run at
    └── activation buffers: per-token tensors (leading dims = the batch's tokens, >= 2 values per
        token), not parameter-shaped: kernels touching an fp32 one are the leak in kernel form

CPU (C++ kernels) is the dialect this machine produces; the CUDA (Triton) dialect follows the same
structure with dtypes from ``triton_meta['signature']``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from fx_precision.dtypes import dtype_name

_CPP_TYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "at::BFloat16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "at::Half": torch.float16,
    "half": torch.float16,
    "int64_t": torch.int64,
    "int32_t": torch.int32,
    "bool": torch.bool,
    "uint8_t": torch.uint8,
    "int8_t": torch.int8,
}
_TRITON_TYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
    "i64": torch.int64,
    "i32": torch.int32,
    "i1": torch.bool,
}
_ALLOC = re.compile(r"^\s*(\w+) = empty_strided_(?:cpu|cuda)\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_ASSERT = re.compile(r"^\s*assert_size_stride\((\w+), \(([^)]*)\), \(([^)]*)\)")
_ALIAS = re.compile(r"^\s*(\w+) = reinterpret_tensor\((\w+), \(([^)]*)\)")
_CPP_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[([^\]]*)\]")
_CALL = re.compile(r"^\s*(\w+)(?:\.run)?\((.*)\)\s*$")
_EXTERN = re.compile(r"^\s*(?:(\w+) = )?(extern_kernels\.\w+|torch\.ops\.[\w.]+)\((.*)\)\s*$")


def _shape(text: str) -> tuple[int, ...] | None:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        return None  # symbolic


@dataclass(frozen=True)
class KernelArg:
    buffer: str
    dtype: torch.dtype
    numel: int | None
    write: bool

    @property
    def nbytes(self) -> int:
        return (self.numel or 0) * self.dtype.itemsize


@dataclass
class Kernel:
    name: str
    args: list[KernelArg]
    extern: bool = False


@dataclass
class KernelCensus:
    kernels: list[Kernel] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)

    def generated(self) -> list[Kernel]:
        return [k for k in self.kernels if not k.extern]

    def externs(self) -> list[Kernel]:
        return [k for k in self.kernels if k.extern]

    def bytes_by_dtype(self, *, extern: bool = False, write: bool | None = None, only: set[str] | None = None) -> dict[str, int]:
        out: Counter[str] = Counter()
        for kernel in self.externs() if extern else self.generated():
            for arg in kernel.args:
                if (write is None or arg.write == write) and (only is None or arg.buffer in only):
                    out[dtype_name(arg.dtype)] += arg.nbytes
        return dict(out)

    def activation_buffers(self, tokens: int, param_shapes: set[tuple[int, ...]], widths: set[int] | None = None) -> set[str]:
        """Buffers holding per-token values: leading dims multiply to ``tokens``, >= 2 values per token.

        ``widths``: keep only those whose per-token size is one of these (the residual-stream width
        and the vocabulary: the *stream* buffers of the precision contract).
        """
        out = set()
        for name, shape in self.shapes.items():
            if not shape or shape in param_shapes or tuple(reversed(shape)) in param_shapes:
                continue
            size = per_token_size(shape, tokens)
            if size is not None and size >= 2 and (widths is None or size in widths):
                out.add(name)
        return out

    def kernels_touching(self, buffers: set[str], dtype: torch.dtype) -> list[Kernel]:
        return [k for k in self.generated() if any(a.buffer in buffers and a.dtype == dtype for a in k.args)]

    def merge(self, other: KernelCensus) -> KernelCensus:
        return KernelCensus(self.kernels + other.kernels, {**self.shapes, **other.shapes})


def per_token_size(shape: tuple[int, ...], tokens: int) -> int | None:
    """Values per token if the leading dims multiply to ``tokens`` ((B, S, D) or (B*S, D) -> D), else None."""
    lead = 1
    for i, dim in enumerate(shape):
        lead *= dim
        if lead == tokens:
            return math.prod(shape[i + 1 :])
        if lead > tokens:
            return None
    return None


def _split_args(text: str) -> list[str]:
    args, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        cur += ch
    if cur.strip():
        args.append(cur.strip())
    return args


def parse_wrapper(code: str, prefix: str = "") -> KernelCensus:
    """Parse one Inductor wrapper module (forward or backward). Buffer names get ``prefix``."""
    census = KernelCensus()
    signatures: dict[str, list[tuple[torch.dtype, bool]]] = {}
    dtypes: dict[str, torch.dtype] = {}
    alias: dict[str, str] = {}

    for line in code.splitlines():
        m = _CPP_DEF.match(line)
        if m:
            sig = []
            for item in re.findall(r"'([^']*)'", m.group(2)):
                const = item.startswith("const ")
                base = item.removeprefix("const ").rstrip("*").strip()
                sig.append((_CPP_TYPES.get(base, torch.float32), not const))
            signatures[m.group(1)] = sig
    for m in re.finditer(r"(\w+) = async_compile\.triton\('\w+', '''(.*?)'''", code, re.DOTALL):
        meta = re.search(r"'signature': \{([^}]*)\}", m.group(2))
        if meta:
            sig = [
                (_TRITON_TYPES[kind], name.startswith(("out_ptr", "in_out_ptr")))
                for name, kind in re.findall(r"'(\w+)': '\*(\w+)'", meta.group(1))  # pointer arguments only
                if kind in _TRITON_TYPES
            ]
            signatures[m.group(1)] = sig

    def resolve(token: str) -> tuple[str, tuple[int, ...] | None] | None:
        token = token.strip()
        rt = re.match(r"reinterpret_tensor\((\w+), \(([^)]*)\)", token)
        if rt:
            base = alias.get(rt.group(1), rt.group(1))
            return prefix + base, _shape(rt.group(2))
        if re.fullmatch(r"\w+", token) and not token.isdigit():
            base = alias.get(token, token)
            return prefix + base, census.shapes.get(prefix + base)
        return None

    for line in code.splitlines():
        if m := _ALLOC.match(line):
            census.shapes[prefix + m.group(1)] = _shape(m.group(2))
            dtypes[prefix + m.group(1)] = getattr(torch, m.group(4))
            continue
        if m := _ASSERT.match(line):
            census.shapes.setdefault(prefix + m.group(1), _shape(m.group(2)))
            continue
        if m := _ALIAS.match(line):
            alias[m.group(1)] = alias.get(m.group(2), m.group(2))
            continue
        if m := _EXTERN.match(line):  # a returned extern output has no allocation line: its size is unknown
            args = []
            for token in _split_args(m.group(3)):
                write = token.startswith("out=")
                resolved = resolve(token.removeprefix("out="))
                if resolved is None:
                    continue
                name, shape = resolved
                dtype = dtypes.get(name)
                if dtype is None or shape is None:
                    continue
                args.append(KernelArg(name, dtype, math.prod(shape), write))
            census.kernels.append(Kernel(m.group(2), args, extern=True))
            continue
        if (m := _CALL.match(line)) and m.group(1) in signatures:
            sig = signatures[m.group(1)]
            args = []
            tokens = _split_args(re.sub(r",?\s*stream=\w+", "", m.group(2)))
            pointer_tokens = [t for t in tokens if resolve(t) is not None][: len(sig)]
            for token, (dtype, write) in zip(pointer_tokens, sig, strict=False):
                name, shape = resolve(token)  # type: ignore[misc]
                dtypes.setdefault(name, dtype)
                args.append(KernelArg(name, dtype, math.prod(shape) if shape is not None else None, write))
            census.kernels.append(Kernel(m.group(1), args))
    return census


def census_of_code(codes: list[str]) -> KernelCensus:
    """Forward and backward wrappers together (buffer names prefixed ``g0.``, ``g1.``, ...)."""
    total = KernelCensus()
    for i, code in enumerate(codes):
        total = total.merge(parse_wrapper(code, prefix=f"g{i}."))
    return total


def summary(census: KernelCensus, *, tokens: int, param_shapes: set[tuple[int, ...]], stream_widths: set[int]) -> dict[str, Any]:
    """The figures the benchmark reports for one compiled variant.

    ``activation``: stream buffers (per token, at the residual-stream width or the vocabulary),
    what the contract keeps at compute dtype. ``per_token``: every per-token buffer, including
    fp32 islands the program asks for (e.g. GatedDeltaNet's fp32 recurrence), which no variant,
    not even the pure-bf16 limit, removes.
    """
    acts = census.activation_buffers(tokens, param_shapes, stream_widths)
    per_token = census.activation_buffers(tokens, param_shapes)
    touching = census.kernels_touching(acts, torch.float32)
    touching_any = census.kernels_touching(per_token, torch.float32)
    return {
        "kernels": len(census.generated()),
        "kernels_touching_fp32_activations": len(touching),
        "kernels_touching_fp32_activations_names": sorted({k.name for k in touching})[:20],
        "kernels_touching_fp32_per_token": len(touching_any),
        "bytes_read": census.bytes_by_dtype(write=False),
        "bytes_written": census.bytes_by_dtype(write=True),
        "activation_bytes": census.bytes_by_dtype(only=acts),
        "activation_bytes_total": sum(census.bytes_by_dtype(only=acts).values()),
        "per_token_bytes": census.bytes_by_dtype(only=per_token),
        "per_token_bytes_total": sum(census.bytes_by_dtype(only=per_token).values()),
        "extern_calls": len(census.externs()),
        "extern_bytes": census.bytes_by_dtype(extern=True),
        "grouped_gemm_calls": grouped_gemm_calls(census),
    }


def grouped_gemm_calls(census: KernelCensus) -> dict[str, int]:
    """MoE expert GEMMs (``grouped_mm`` calls, forward and backward) by the dtype they run at: the dtype
    of the activation they read (the op needs one dtype; a weight input has no allocation line)."""
    counts: Counter[str] = Counter()
    for kernel in census.externs():
        if "grouped_mm" in kernel.name:
            read = [arg.dtype for arg in kernel.args if not arg.write]
            counts[dtype_name(read[0]) if read else "unknown"] += 1
    return dict(counts)
