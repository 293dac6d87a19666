"""The engine's CPU kernels as a small native library: built at first use, loaded with ctypes.

    one file per op family, sharing engine_kernels.h ──g++ -O2 -shared──▶ <cache>/engine_kernels-<hash of sources,
    headers, flags, compiler>.so
        attention_kernels.cpp  fxp_attention     attention in the engine's arithmetic (AMX tiles, or the vector variants);
                               fxp_cpu_has_*     what this CPU runs
        linear_kernels.cpp     fxp_linear        a linear in one of the engine's GEMM orders (AMX chunks, VDPBF16PS pairs,
                                                 torch's lanes); fxp_chunk_dots, fxp_order_fold, fxp_product_fold: the linear
                                                 probe's candidates, output by output
        moe_kernels.cpp        fxp_fused_moe     mixture-of-experts experts in the engine's arithmetic (vLLM's CPU fused experts)
        gdn_kernels.cpp        fxp_gdn_*         GatedDeltaNet's conv, gating and delta rule (contract/gdn.py calls them)
        gdn_avx512_kernels.cpp fxp_gdn512_*      the same as the engine's AVX-512 build computes them (packed conv, exp_u20,
                                                 VRCP14PS, oneDNN's brgemm order)

The library includes no torch or Python headers, so it builds in a second or two with any C++17
compiler (``$CXX``, else ``g++``); tensors cross as raw pointers, and every argument is checked here
first. The cache is ``$FX_PRECISION_CACHE``, else ``~/.cache/fx_precision`` (else the temp directory);
a build is written to a temporary name and renamed, so ranks building at once never load half a file.
Calls release the GIL and split the work over ``torch.get_num_threads()`` OpenMP threads: the library
binds to the libgomp torch loaded, so they are torch's own worker threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import ClassVar

import torch

from fx_precision.contract.vocabulary import MOE_COMBINES, MOE_EXPS, MOE_STORES
from fx_precision.errors import PrecisionError

SOURCES = tuple(Path(__file__).with_name(name) for name in ("attention_kernels.cpp", "linear_kernels.cpp", "moe_kernels.cpp",
                                                               "gdn_kernels.cpp", "gdn_avx512_kernels.cpp"))  # fmt: skip
HEADERS = (Path(__file__).with_name("engine_kernels.h"),)  # what the sources share (in the build's key too)  # one file per op family
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-finite-math-only")
_BUILD_LOCK = threading.Lock()
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


def _torch_symbol(symbol: str) -> int | None:
    """The address of torch's own function ``symbol`` (in libtorch_cpu: SLEEF's, cpublas': the very functions vLLM's kernel builds
    call), or None where this torch has none (not an x86 build)."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.exists():
        return None
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(str(library)), symbol), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return int(address) if address else None


def _sleef_logf16() -> int | None:
    """``Sleef_logf16_u10`` (SLEEF's 16-lane log, which vLLM's AVX-512 build calls: its GDN gating), on an AVX-512 CPU."""
    return _torch_symbol("Sleef_logf16_u10") if torch.cpu._is_avx512_supported() else None


BRGEMM_BF16 = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"  # at::native::cpublas::brgemm (bf16 in, fp32 out)
BRGEMM_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"  # at::native::cpublas::brgemm_release(bool)


def _torch_brgemm() -> tuple[int, int] | None:
    """libtorch's bf16 brgemm and its release (the functions vLLM's AVX-512 GDN kernels call), on an AVX-512 BF16 CPU
    (elsewhere torch's brgemm does not run bf16): None where this torch lacks either."""
    if not torch.cpu._is_avx512_bf16_supported():
        return None
    call, release = _torch_symbol(BRGEMM_BF16), _torch_symbol(BRGEMM_RELEASE)
    return (call, release) if call is not None and release is not None else None


def _sleef_expf8() -> int | None:
    """``Sleef_expf8_u10`` (SLEEF's 8-lane exp, which vLLM's AVX2 kernel build calls), on an AVX2 CPU."""
    return _torch_symbol("Sleef_expf8_u10") if torch.cpu._is_avx2_supported() else None


def _cache_dir() -> Path:
    configured = os.environ.get("FX_PRECISION_CACHE")
    for candidate in ([Path(configured)] if configured else []) + [
        Path.home() / ".cache" / "fx_precision",
        Path(tempfile.gettempdir()) / "fx_precision",
    ]:
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise PrecisionError("the engine kernels need a writable cache directory: set FX_PRECISION_CACHE")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise PrecisionError(
            f"the engine contract's kernels are built at first use with a C++ compiler, and {cxx!r} is not on PATH: "
            "install g++ (or set CXX)"
        )
    return cxx


def build_library() -> Path:
    """The kernels' shared library for this source, these flags and this compiler: built once, then reused."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + repr((FLAGS, version)).encode()).hexdigest()[:16]
    library = _cache_dir() / f"engine_kernels-{key}.so"
    if library.exists():
        return library
    partial = library.with_name(f"{library.stem}.{os.getpid()}.{threading.get_ident()}.partial.so")
    done = subprocess.run([cxx, *FLAGS, *map(str, SOURCES), "-o", str(partial)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.strip().splitlines() or ["?"]
        raise PrecisionError(
            f"building the engine kernels failed ({errors[0][:300]}); the engine contract needs a C++17 compiler (g++ 11 or later)"
        )
    os.replace(partial, library)
    return library


class LinearOrderStruct(ctypes.Structure):
    """``FxpLinearOrder`` of linear_kernels.cpp: how the engine sums one output of a linear (contract/linear_order.py)."""

    _fields_ = [
        ("kernel", ctypes.c_int32),
        ("bias_first", ctypes.c_int32),
        ("n_blocks", ctypes.c_int32),
        ("n_parts", ctypes.c_int32),
        ("block_units", ctypes.POINTER(ctypes.c_int32)),
        ("part_blocks", ctypes.POINTER(ctypes.c_int32)),
        ("lanes", ctypes.c_int32),
    ]


KERNEL_CODES = {"amx-chunks": 0, "pairs": 1, "lanes": 2, "gemv16": 3, "gemv16-hadd": 4}  # FxpLinearOrder.kernel


def order_struct(kernel: str, bias_first: bool, blocks: tuple[int, ...], parts: tuple[int, ...], lanes: int = 0) -> LinearOrderStruct:
    """The C struct of one order; its arrays live as long as the struct (kept on it)."""
    block_array = (ctypes.c_int32 * len(blocks))(*blocks)
    part_array = (ctypes.c_int32 * len(parts))(*parts)
    struct = LinearOrderStruct(KERNEL_CODES[kernel], int(bias_first), len(blocks), len(parts), block_array, part_array, lanes)
    struct._keep = (block_array, part_array)
    return struct


class AttentionVariantStruct(ctypes.Structure):
    """``FxpAttentionVariant`` of attention_kernels.cpp: one arithmetic of the engine's attention kernel."""

    _fields_ = [(name, ctypes.c_int32) for name in ("scores", "exp", "lane_sum", "p_bf16", "fma", "store", "flush", "merge_fma")]


def attention_variant(scores: str, exp: str, lane_sum: str, p_bf16: bool, fma: bool, store: str,
                      merge_fma: bool = True) -> AttentionVariantStruct:  # fmt: skip
    """The C struct of an attention arithmetic given by its names (``AttentionArithmetic.op_args``)."""
    codes = {"scores": {"amx": 0, "vec": 1}, "exp": {"libm": 0, "fast512": 1}, "lane_sum": {"avx512": 0, "avx2": 1},
             "store": {"nearest-even": 0, "truncate": 1}}  # fmt: skip
    named = {"scores": scores, "exp": exp, "lane_sum": lane_sum, "store": store}
    for key, value in named.items():
        if value not in codes[key]:
            raise PrecisionError(f"engine attention: {key}={value!r}: one of {', '.join(codes[key])}")
    return AttentionVariantStruct(
        codes["scores"][scores], codes["exp"][exp], codes["lane_sum"][lane_sum], int(p_bf16), int(fma), codes["store"][store],
        int(scores == "amx"),  # AMX flushes denormals
        int(merge_fma),
    )  # fmt: skip


class EngineKernels:
    """The loaded library, with tensor-level calls that check what the C side assumes."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.fxp_attention.argtypes = [_P] * 6 + [_I64] * 7 + [ctypes.c_double, _INT, _I64, _I64, ctypes.POINTER(AttentionVariantStruct),
                                                                 _INT, _I64, _P, _I64]  # fmt: skip
        lib.fxp_attention.restype = None
        lib.fxp_linear.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, ctypes.POINTER(LinearOrderStruct), _I64, _INT]
        lib.fxp_linear.restype = None
        lib.fxp_chunk_dots.argtypes = [_P, _P, _P, _I64, _I64]
        lib.fxp_chunk_dots.restype = None
        lib.fxp_order_fold.argtypes = [_P, _P, _P, _I64, _I64, ctypes.POINTER(LinearOrderStruct)]
        lib.fxp_order_fold.restype = None
        lib.fxp_chunk_dots_emulated.argtypes = [_P, _P, _P, _I64, _I64]
        lib.fxp_chunk_dots_emulated.restype = None
        lib.fxp_product_fold.argtypes = [_P, _P, _P, _P, _I64, _I64, ctypes.POINTER(LinearOrderStruct)]
        lib.fxp_product_fold.restype = None
        lib.fxp_fused_moe.argtypes = [_P] * 6 + [_I64] * 7
        lib.fxp_fused_moe.restype = None
        lib.fxp_set_sleef_expf8.argtypes = [_P]
        lib.fxp_set_sleef_expf8.restype = None
        self.sleef_expf8 = _sleef_expf8()
        if self.sleef_expf8 is not None:
            lib.fxp_set_sleef_expf8(self.sleef_expf8)
        lib.fxp_gdn512_set_brgemm.argtypes = [_P, _P]
        lib.fxp_gdn512_set_brgemm.restype = None
        self.torch_brgemm = _torch_brgemm()
        if self.torch_brgemm is not None:
            lib.fxp_gdn512_set_brgemm(*self.torch_brgemm)
        lib.fxp_gdn512_set_log.argtypes = [_P]
        lib.fxp_gdn512_set_log.restype = None
        self.sleef_logf16 = _sleef_logf16()
        if self.sleef_logf16 is not None:
            lib.fxp_gdn512_set_log(self.sleef_logf16)
        lib.fxp_set_vector_path.argtypes = [_INT]
        lib.fxp_set_vector_path.restype = None
        lib.fxp_cpu_has_amx.restype = _INT
        lib.fxp_cpu_has_avx512_bf16.restype = _INT
        self.lib = lib
        self.path = library

    def cpu_has_amx(self) -> bool:
        """Whether this CPU runs AMX bf16 tiles."""
        return bool(self.lib.fxp_cpu_has_amx())

    def cpu_has_avx512_bf16(self) -> bool:
        """Whether this CPU runs AVX-512 BF16 dot products."""
        return bool(self.lib.fxp_cpu_has_avx512_bf16())

    VECTOR_PATHS = ("best", "avx512f", "avx2", "scalar")

    def set_vector_path(self, path: str) -> None:
        """The widest vector path the attention, pairs and lanes kernels take: the CPU's best (the default), or a narrower one
        (tests hold every path to the scalar reference on one machine)."""
        if path not in self.VECTOR_PATHS:
            raise PrecisionError(f"vector path {path!r}: one of {', '.join(self.VECTOR_PATHS)}")
        self.lib.fxp_set_vector_path(self.VECTOR_PATHS.index(path))

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_lens: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        causal: bool,
        window: int,
        q_offset: int,
        variant: AttentionVariantStruct,
        *,
        rowwise: bool = False,
        kv_tiles: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, T, H, D], k / v [B, S, KVH, D] bf16 on the CPU; key_lens [B]; mask [B, 1|H, T, S] bool or
        None; variant: ``attention_variant(...)``. rowwise: one query row at a time (the tiled path's reference).
        kv_tiles [B, T, N, 4] int32: each row's keys as the engine took them, in N split-KV parts (first key, end key,
        first tile's first key, keys per tile; 0 keys: one tile; end <= first: no part), or None: one tile per row."""
        tensors = {"q": q, "k": k, "v": v}
        for name, t in tensors.items():
            if t.dtype != torch.bfloat16 or t.dim() != 4 or t.device.type != "cpu":
                raise PrecisionError(
                    f"engine attention: {name} must be a 4-d bf16 CPU tensor, got {tuple(t.shape)} {t.dtype} on {t.device}"
                )
        B, T, H, D = q.shape
        S, KVH = k.shape[1], k.shape[2]
        if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or KVH == 0 or H % KVH != 0:
            raise PrecisionError(
                f"engine attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit [B, T, H, D] / [B, S, KVH, D] "
                "with H a multiple of KVH"
            )
        lens = key_lens.to(device="cpu", dtype=torch.int64).contiguous()
        if lens.shape != (B,):
            raise PrecisionError(f"engine attention: key_lens must be [B] = [{B}], got {tuple(lens.shape)}")
        heads = 1
        if mask is not None:
            mask = mask.to(device="cpu", dtype=torch.bool).contiguous()
            heads = mask.shape[1] if mask.dim() == 4 else -1
            if mask.dim() != 4 or (mask.shape[0], mask.shape[2], mask.shape[3]) != (B, T, S) or heads not in (1, H):
                raise PrecisionError(
                    f"engine attention: the mask must be [B, 1 or H, T, S] = [{B}, 1|{H}, {T}, {S}], got {tuple(mask.shape)}"
                )
        if kv_tiles is not None:
            if kv_tiles.dim() != 4 or tuple(kv_tiles.shape[:2]) != (B, T) or kv_tiles.shape[2] < 1 or kv_tiles.shape[3] != 4:
                raise PrecisionError(f"engine attention: kv_tiles must be [B, T, N, 4] = [{B}, {T}, N, 4], got {tuple(kv_tiles.shape)}")
            kv_tiles = kv_tiles.to(device="cpu", dtype=torch.int32).contiguous()
            if bool((kv_tiles[..., 3] < 0).any()) or bool((kv_tiles[..., 3] % 32 != 0).any()):
                raise PrecisionError("engine attention: kv_tiles' keys per tile must be 0 (one tile) or a positive multiple of 32")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        self.lib.fxp_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lens.data_ptr(), mask.data_ptr() if mask is not None else None,
            B, T, H, D, S, KVH, heads, float(scale), int(causal), int(window), int(q_offset), ctypes.byref(variant), int(rowwise),
            torch.get_num_threads(), kv_tiles.data_ptr() if kv_tiles is not None else None,
            int(kv_tiles.shape[2]) if kv_tiles is not None else 0,
        )  # fmt: skip
        return out

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, order: LinearOrderStruct, *, emulate: bool | None = None
    ) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias) summed in ``order`` for every row: bf16 in, bf16 out, whatever this
        process's thread count (the work splits over outputs, never over K). The AMX order on AMX tiles where the CPU
        has them, else (or with ``emulate=True``) the same sums element by element; the pairs order with VDPBF16PS where
        the CPU has it, else the same sums on AVX-512F, AVX2 or scalar code; the lanes order on AVX2 (else scalar)."""
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2 or weight.dim() != 2:
            raise PrecisionError(
                f"engine linear takes 2-d bf16 x and weight, got {x.dtype} {tuple(x.shape)}, {weight.dtype} {tuple(weight.shape)}"
            )
        (M, K), N = x.shape, weight.shape[0]
        _check_order(order, K, f"engine linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        if weight.shape[1] != K:
            raise PrecisionError(f"engine linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ in K")
        amx = order.kernel == KERNEL_CODES["amx-chunks"]
        emulated = (not self.cpu_has_amx()) if emulate is None else emulate
        b32 = bias.to(torch.float32).contiguous() if bias is not None and bias.numel() else None
        if b32 is not None and b32.shape != (N,):
            raise PrecisionError(f"engine linear: bias must be [{N}], got {tuple(b32.shape)}")
        if amx and not emulated and not torch._C._cpu._init_amx():
            raise PrecisionError("the kernel could not get this process's permission to use AMX tiles (arch_prctl XCOMP_PERM)")
        x, weight = x.contiguous().cpu(), weight.contiguous().cpu()
        out = torch.empty((M, N), dtype=torch.bfloat16)
        if M:
            self.lib.fxp_linear(
                x.data_ptr(), weight.data_ptr(), b32.data_ptr() if b32 is not None else None, out.data_ptr(), M, N, K, ctypes.byref(order),
                torch.get_num_threads(), int(emulated),
            )  # fmt: skip
        return out

    MOE_FORMS: ClassVar[dict[str, dict[str, int]]] = {  # the vocabulary's MoE forms -> moe_kernels.cpp's MOE_* bits
        "exp": dict(zip(MOE_EXPS, (0, 1), strict=True)), "store": dict(zip(MOE_STORES, (0, 2), strict=True)),
        "combine": dict(zip(MOE_COMBINES, (0, 4), strict=True)),
    }  # fmt: skip

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  exp: str = "fast512", store: str = "nearest-even", combine: str = "fma") -> torch.Tensor:  # fmt: skip
        """The engine's fused experts (moe_kernels.cpp, fxp_fused_moe): x [T, H], w13 [E, 2I, H] (gate rows, then up
        rows), w2 [E, H, I] bf16; the routes' weights [T, K] (fp32) and expert ids [T, K]; out [T, H] bf16, whatever
        this process's thread count. ``exp``, ``store``, ``combine``: the form of the engine's kernel build (MOE_FORMS;
        contract/moe.py)."""
        form = 0
        for name, value in (("exp", exp), ("store", store), ("combine", combine)):
            if value not in self.MOE_FORMS[name]:
                raise PrecisionError(f"engine fused experts: {name}={value!r}, one of {', '.join(self.MOE_FORMS[name])}")
            form |= self.MOE_FORMS[name][value]
        if exp == "sleef" and self.sleef_expf8 is None:
            raise PrecisionError(
                "engine fused experts, exp='sleef' (vLLM's AVX2 build): this torch exports no Sleef_expf8_u10; run the training side "
                "on an x86 build of torch, as the engine's"
            )
        if any(t.dtype != torch.bfloat16 for t in (x, w13, w2)) or x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
            raise PrecisionError(
                f"engine fused experts take bf16 x [T, H], w13 [E, 2I, H] and w2 [E, H, I], got {x.dtype} {tuple(x.shape)}, "
                f"{w13.dtype} {tuple(w13.shape)}, {w2.dtype} {tuple(w2.shape)}"
            )
        (T, H), (E, two_i, _) = x.shape, w13.shape
        fits = w13.shape[2] == H and not two_i % 2 and w2.shape == (E, H, two_i // 2)
        if not fits or weights.shape != ids.shape or ids.dim() != 2 or ids.shape[0] != T:
            raise PrecisionError(
                f"engine fused experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, weights {tuple(weights.shape)} "
                f"and ids {tuple(ids.shape)} do not fit one another"
            )
        ids64 = ids.to(torch.int64).contiguous().cpu()
        if ids64.numel() and (int(ids64.min()) < 0 or int(ids64.max()) >= E):
            raise PrecisionError(f"engine fused experts: expert ids must lie in [0, {E}), got {int(ids64.min())}..{int(ids64.max())}")
        x, w13, w2 = (t.contiguous().cpu() for t in (x, w13, w2))
        w32 = weights.to(torch.float32).contiguous().cpu()
        out = torch.empty((T, H), dtype=torch.bfloat16)
        if T:
            self.lib.fxp_fused_moe(x.data_ptr(), w13.data_ptr(), w2.data_ptr(), w32.data_ptr(), ids64.data_ptr(), out.data_ptr(), T, H,
                                   two_i // 2, ids.shape[1], E, torch.get_num_threads(), form)  # fmt: skip
        return out

    def chunk_dots(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[P, ceil(K / 32)] fp32: the sum one TDPBF16PS adds for each 32-element chunk of x_i . w_i (from 0): the
        hardware's own where this CPU runs AMX, else the same sums element by element."""
        if x.shape != w.shape or x.dim() != 2 or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
            raise PrecisionError(f"chunk_dots takes two [P, K] bf16 tensors, got {tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}")
        P, K = x.shape
        out = torch.empty((P, (K + 31) // 32), dtype=torch.float32)
        hardware = self.cpu_has_amx() and torch._C._cpu._init_amx()
        run = self.lib.fxp_chunk_dots if hardware else self.lib.fxp_chunk_dots_emulated
        x, w = x.contiguous(), w.contiguous()  # held until the call returns: a pointer outlives no tensor
        run(x.data_ptr(), w.data_ptr(), out.data_ptr(), P, K)
        return out

    def order_fold(self, dots: torch.Tensor, bias: torch.Tensor | None, order: LinearOrderStruct) -> torch.Tensor:
        """[P] bf16: each output folded from its chunk dots ([P, chunks] fp32) in ``order``, then bias, one store."""
        P, chunks = dots.shape
        if sum(order.block_units[i] for i in range(order.n_blocks)) != chunks:
            raise PrecisionError(f"order_fold: the order's blocks do not cover the {chunks} chunks")
        b32 = bias.to(torch.float32).contiguous() if bias is not None else None
        out = torch.empty(P, dtype=torch.bfloat16)
        dots = dots.contiguous()
        self.lib.fxp_order_fold(
            dots.data_ptr(), b32.data_ptr() if b32 is not None else None, out.data_ptr(), P, chunks, ctypes.byref(order)
        )
        return out

    def product_fold(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, order: LinearOrderStruct) -> torch.Tensor:
        """[P] bf16: output i = x_i . w_i (+ bias_i) summed in a pairs or lanes ``order`` (the probe's candidates)."""
        if x.shape != w.shape or x.dim() != 2 or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
            raise PrecisionError(f"product_fold takes two [P, K] bf16 tensors, got {tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}")
        if order.kernel == KERNEL_CODES["amx-chunks"]:
            raise PrecisionError("product_fold folds pairs and lanes orders; an AMX order folds its chunk dots (order_fold)")
        _check_order(order, x.shape[1], "product_fold")
        b32 = bias.to(torch.float32).contiguous() if bias is not None else None
        out = torch.empty(x.shape[0], dtype=torch.bfloat16)
        x, w = x.contiguous(), w.contiguous()
        self.lib.fxp_product_fold(
            x.data_ptr(), w.data_ptr(), b32.data_ptr() if b32 is not None else None, out.data_ptr(), *x.shape,
            ctypes.byref(order),
        )  # fmt: skip
        return out


UNIT = {0: 32, 1: 2, 2: 0, 3: 0, 4: 0}  # K elements per block unit, by kernel code (lanes, the GEMVs: one block, the whole of K)
GEMV_CODES = (KERNEL_CODES["gemv16"], KERNEL_CODES["gemv16-hadd"])  # oneDNN's 1-wide GEMVs: 16 lanes


def _check_order(order: LinearOrderStruct, K: int, where: str) -> None:
    """What the C side assumes of an order for K: known kernel, blocks covering K's units, parts covering the blocks,
    K even for the pairs and AMX kernels, 8 lanes for the lanes kernel."""
    blocks = [order.block_units[i] for i in range(order.n_blocks)]
    parts = [order.part_blocks[i] for i in range(order.n_parts)]
    if order.kernel not in UNIT:
        raise PrecisionError(f"{where}: kernel code {order.kernel}: one of {sorted(UNIT)}")
    unit = UNIT[order.kernel]
    units = 1 if unit == 0 else (K + unit - 1) // unit
    covered = sum(blocks) == units and sum(parts) == len(blocks) and min(blocks + parts, default=0) >= 1
    if not covered or (unit and K % 2) or (order.kernel == 2 and order.lanes != 8) or (order.kernel in GEMV_CODES and order.lanes != 16):
        raise PrecisionError(
            f"{where}: order blocks {blocks} parts {parts}: the blocks must cover K = {K}'s {units} unit(s), the parts every block, K "
            "even (AMX and pairs kernels), lanes 8 (the lanes kernel), 16 (the 1-wide GEMVs)"
        )


@functools.lru_cache(maxsize=1)
def engine_kernels() -> EngineKernels:
    """The kernels for this process (built on first call: a second or two; then from the cache)."""
    with _BUILD_LOCK:
        return EngineKernels(build_library())
