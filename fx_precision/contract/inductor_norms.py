"""The compiled engine's RMS-norm reductions: the one order-dependent sum Inductor writes between its extern calls.

Inductor's C++ kernel for ``mean(x ** 2)`` accumulates the squares of a row in a vector register of ``lanes``
floats (the loop's step), chunk after chunk, then folds the register: its ``lanes / width`` vectors of ``width``
floats added in order, then a butterfly inside one vector (lane i plus lane i ^ s, for s = width / 2 .. 1; ATen's
``vec_reduce_all``). Every other op between the GEMMs is elementwise, so this order is all that a norm's bits depend
on, and Inductor picks ``lanes`` per fused kernel from the dtypes of what that kernel's loops load and store
(codegen/cpp.py ``select_tiling``: 32 where every loop body touches bf16, 16 otherwise, on AVX-512). The engine
compiles its whole model as one graph; the training side under FSDP2 compiles one graph per unit, so the same norm
can land in a kernel of another width there. Read once off the engine's generated code and bound to the training
model's norm modules, the order is given to the training graph as ``fxp_engine.inductor_sum_squares``, which Inductor
cannot re-vectorise::

    engine's output code --norm_reductions_of--> (lanes, width, size) per norm, in the order the graph calls them
    training model       --bind_norm_modules---> the same, each with the module that calls it (a forward's hooks)
    norm rewrite (passes/rewrites/engine/norm.py): mean(x ** 2) -> inductor_sum_squares(x, lanes, width) / size

Where the kernel also stores the norm's input (Inductor realises the residual stream there: a pointwise chain that
reads too many buffers, as Granite's ``residual + h * residual_multiplier`` grows layer by layer), the buffer's
dtype decides what comes after: an fp32 buffer (vLLM's fused add and norm, whose sum is fp32) changes nothing; a bf16
one (a model that adds its residual itself in bf16) is the rounding the kernel normalises and every later kernel
reads (``stores``). Whether the sum of squares takes that rounding too depends on where the store is (``summed``)::

    in the reduction loop:   s = r + h * m (fp32); out = bf16(s); acc += s * s       stores "bfloat16", summed "fp32"
                             (the store's cache hands the loop the fp32 value)
    in a loop before it:     out = bf16(r + h * m); ...; x = float(out); acc += x * x stores "bfloat16", summed "stored"
    then:                    y = float(out) * rsqrt(acc / size + eps) * w              (fxp_engine.inductor_stream rounds
                                                                                       the training side's stream there)
"""

from __future__ import annotations

import glob
import os
import re
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fx_precision.errors import PrecisionError

_ACC = re.compile(r"at::vec::(?:VectorizedN<float,(\d+)>|Vectorized<float>) (tmp_acc\d+)_vec = [^;]*;\s*"
                  r"for\(int64_t (x\d+)=static_cast<int64_t>\(0L\); \3<static_cast<int64_t>\((\d+)L\); "
                  r"\3\+=static_cast<int64_t>\((\d+)L\)\)")  # fmt: skip
_SQUARE = re.compile(r"auto (tmp\d+) = (tmp\d+) \* \2;")
_NARROWED = re.compile(r"auto (tmp\d+) = at::vec::convert<at::(BFloat16|Half)[,>][^;]*>\((tmp\d+)\);")
_STORE = re.compile(r"(tmp\d+)\.store\((\w+) ")
_STORED_DTYPES = {"BFloat16": "bfloat16", "Half": "float16"}
_KERNEL = re.compile(r"^(cpp_fused\w+) = async_compile\.cpp_pybinding\(.*?r'''(.*?)'''\)", re.M | re.S)
_CALL = re.compile(r"^\s+(cpp_fused\w+)\(", re.M)


@dataclass(frozen=True)
class NormReduction:
    """One norm's sum of squares as the engine's kernel computes it: ``lanes`` floats accumulated per chunk, folded
    as vectors of ``width``, over rows of ``size``; ``module``: the training model's norm module that computes it
    (None until bound, ``bind_norm_modules``); ``stores``: the dtype the kernel stores the norm's input in before it
    normalises that rounding, None where it normalises the fp32 value; ``summed``: what its sum of squares takes, the
    fp32 value or the stored rounding (module docstring)."""

    lanes: int
    width: int
    size: int
    module: str | None = None
    stores: str | None = None
    summed: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("lanes", "width", "size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PrecisionError(f"NormReduction.{name}={value!r}: a positive integer")
        if self.lanes % self.width or self.width & (self.width - 1):
            raise PrecisionError(f"NormReduction: lanes {self.lanes} must be whole vectors of a power-of-two width, got {self.width}")
        if self.module is not None and not isinstance(self.module, str):
            raise PrecisionError(f"NormReduction.module={self.module!r}: a module name or null")
        if self.stores not in (None, *_STORED_DTYPES.values()):
            raise PrecisionError(f"NormReduction.stores={self.stores!r}: one of {sorted(_STORED_DTYPES.values())} or null")
        if self.summed not in ("fp32", "stored") or (self.summed == "stored" and self.stores is None):
            raise PrecisionError(f"NormReduction.summed={self.summed!r}: 'fp32', or 'stored' where the kernel stores "
                                 f"(stores={self.stores!r})")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "lanes": self.lanes,
            "width": self.width,
            "size": self.size,
            "module": self.module,
            "stores": self.stores,
            "summed": self.summed,
        }

    @classmethod
    def from_dict(cls, data: object) -> NormReduction:
        keys = {"lanes", "width", "size", "module"}
        if not isinstance(data, dict) or set(data) not in (keys, keys | {"stores", "summed"}):  # older dumps: neither
            raise PrecisionError(f"contract.norm_reductions: objects of lanes, width, size, module, stores, summed, got {data!r}"[:300])
        return cls(data["lanes"], data["width"], data["size"], data["module"], data.get("stores"), data.get("summed", "fp32"))


def _narrowings(code: str) -> dict[str, tuple[str, str]]:
    """Each narrowing cast in ``code``: its variable -> (the dtype, the variable it narrows)."""
    return {m.group(1): (_STORED_DTYPES[m.group(2)], m.group(3)) for m in _NARROWED.finditer(code)}


def _stored_rounding(before: str, body: str, base: str, rest: str) -> tuple[str | None, str]:
    """(stores, summed) of one norm (module docstring): the reduction loop ``body`` sums ``base`` squared; ``before``:
    the kernel's code before that loop, ``rest``: after it, up to the next reduction. A narrowing of ``base`` stored in
    the loop and read back after it: (dtype, "fp32"); ``base`` the widening of a load from a buffer the kernel stored
    a narrowing in before the loop: (dtype, "stored"); else (None, "fp32")."""
    narrowed = _narrowings(body)
    for store in _STORE.finditer(body):
        if store.group(1) in narrowed and narrowed[store.group(1)][1] == base and re.search(rf"loadu\({store.group(2)} \+", rest):
            return narrowed[store.group(1)][0], "fp32"
    widened = re.search(rf"auto {base} = at::vec::convert<float[^;]*>\((tmp\d+)\);", body)
    loaded = widened and re.search(rf"auto {widened.group(1)} = at::vec::Vectorized<at::\w+>::loadu\((\w+) \+", body)
    if loaded:
        earlier = _narrowings(before)
        for store in _STORE.finditer(before):
            if store.group(2) == loaded.group(1) and store.group(1) in earlier:
                return earlier[store.group(1)][0], "stored"
    return None, "fp32"


def _kernel_reductions(kernel: str) -> tuple[NormReduction, ...]:
    """The vectorised sums of squares of one kernel's C++ source, in its loops' order."""
    found = []
    start = 0
    for acc in _ACC.finditer(kernel):
        vectors, name, size, step = int(acc.group(1) or 1), acc.group(2), int(acc.group(4)), int(acc.group(5))
        end = kernel.find(f"{name} = {name} + at::vec::vec_reduce_all", acc.end())
        end = end if end > 0 else len(kernel)
        body = kernel[acc.end() : end]
        added = re.search(rf"{name}_vec = {name}_vec \+ (tmp\d+);", body)
        square = next((m for m in _SQUARE.finditer(body) if added is not None and m.group(1) == added.group(1)), None)
        following = _ACC.search(kernel, end)  # the next reduction's loop, if the kernel has one
        if square is not None:  # else another reduction (a max, an integer sum): not a norm
            rest = kernel[end : following.start() if following else len(kernel)]
            stores, summed = _stored_rounding(kernel[start : acc.start()], body, square.group(2), rest)
            found.append(NormReduction(step, step // vectors, size, stores=stores, summed=summed))
        start = end
    return tuple(found)


def norm_reductions_of(source: str) -> tuple[NormReduction, ...]:
    """Every vectorised sum of squares in Inductor's output code ``source`` (a compiled graph's wrapper module), in
    the order its ``call`` runs the kernels (a kernel called twice, say the q / k norms of every layer, counts each
    time). Other reductions are not norms: skipped. Empty where ``source`` holds no ``call``."""
    kernels = {m.group(1): _kernel_reductions(m.group(2)) for m in _KERNEL.finditer(source)}
    call = source.find("def call(self, args):")
    if call < 0:
        call = source.find("def call(args):")
    if call < 0:
        return ()
    body = source[call : source.find("\ndef ", call + 1) if source.find("\ndef ", call + 1) > 0 else len(source)]
    return tuple(r for m in _CALL.finditer(body) for r in kernels.get(m.group(1), ()))


def engine_norm_reductions(cache_dir: str | None, width: int | None = None) -> tuple[tuple[NormReduction, ...] | None, str]:
    """The norm reductions of the compiled engine whose Inductor cache is ``cache_dir`` (vLLM's
    ``compilation_config.local_cache_dir``), and where they were read; (None, why) where they cannot be read whole
    (no output code there, or the norms spread over several graphs, whose order the files do not give). ``width``:
    the engine's vector width in floats; code of another (the same model compiled before under another --isa, which
    vLLM keeps in the same directory) is not this engine's."""
    if not cache_dir:
        return None, "the engine recorded no compile cache directory"
    files = sorted(glob.glob(os.path.join(cache_dir, "inductor_cache", "*", "*.py")))
    read: dict[tuple[NormReduction, ...], list[str]] = {}
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            reductions = norm_reductions_of(fh.read())
        if reductions and (width is None or all(r.width == width for r in reductions)):
            read.setdefault(reductions, []).append(path)
    if not read:
        return None, f"no norm reduction in the engine's generated code under {cache_dir} ({len(files)} file(s))"
    if len(read) > 1:
        return None, f"the engine's norms are spread over {len(read)} compiled graphs under {cache_dir}: their order is not read"
    ((reductions, paths),) = read.items()
    return reductions, paths[0]


def _is_rms_norm(module: nn.Module) -> bool:
    """An RMS norm module: a model's own (``*RMSNorm``) or a GatedDeltaNet layer's gated one (``*RMSNormGated``), whose
    sum of squares the compiled engine's Inductor writes as it writes the others'."""
    return type(module).__name__.endswith(("RMSNorm", "RMSNormGated"))


def norm_call_order(model: nn.Module) -> list[str]:
    """The names of ``model``'s RMS-norm modules (gated ones included) in the order one forward calls them (two tokens, no grad)."""
    calls: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda _m, _a, name=name: calls.append(name)) for name, m in model.named_modules()
             if _is_rms_norm(m)]  # fmt: skip
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def bind_norm_modules(reductions: tuple[NormReduction, ...], model: nn.Module) -> tuple[NormReduction, ...]:
    """``reductions`` (the engine's order) each bound to the norm module of ``model`` that the same place of a forward
    calls; refused where the counts or a module's width differ, or one module would take two orders."""
    calls = norm_call_order(model)
    eager = "roll out with --launch eager for this model"
    if len(calls) != len(reductions):
        raise PrecisionError(
            f"engine contract: the compiled engine's graph holds {len(reductions)} norm reduction(s), the training model calls "
            f"{len(calls)} RMS norm(s): the norms' summation orders cannot be bound to its modules; {eager}"
        )
    bound: dict[str, NormReduction] = {}
    for name, reduction in zip(calls, reductions, strict=True):
        weight = getattr(model.get_submodule(name), "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() != reduction.size:
            raise PrecisionError(f"engine contract: the engine's norm reduction over {reduction.size} values falls on {name}, "
                                 f"of width {weight.numel()}: the engine calls its norms in another order; {eager}")  # fmt: skip
        made = replace(reduction, module=name)
        if bound.setdefault(name, made) != made:
            raise PrecisionError(f"engine contract: {name} is called twice and the engine sums its squares in two orders "
                                 f"(or rounds its input once and not again); {eager}")  # fmt: skip
    return tuple(replace(r, module=name) for name, r in zip(calls, reductions, strict=True))


def ordered_sum_squares(x: torch.Tensor, lanes: int, width: int) -> torch.Tensor:
    """The sum of ``x.float() ** 2`` over the last dim, kept, in the order of Inductor's kernel (module docstring).
    A row whose size is not whole chunks of ``lanes`` gets zeros past its end (a masked tail adds nothing)."""
    xs = x.float()
    size = xs.shape[-1]
    rows = xs.reshape(-1, size)
    pad = -size % lanes
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    squares = (rows * rows).view(rows.shape[0], -1, lanes)
    acc = squares[:, 0].clone()
    for chunk in range(1, squares.shape[1]):
        acc.add_(squares[:, chunk])
    folded = acc[:, :width].clone()
    for vector in range(1, lanes // width):
        folded.add_(acc[:, vector * width : (vector + 1) * width])
    lane = torch.arange(width, device=x.device)
    step = width // 2
    while step:
        folded = folded + folded[:, lane ^ step]
        step //= 2
    return folded[:, :1].contiguous().reshape(*xs.shape[:-1], 1)


_BOUND: list[tuple[weakref.ref[nn.Module], NormReduction]] = []  # every bound norm module of this process, with its order


def register_norm_orders(model: nn.Module, reductions: tuple[NormReduction, ...]) -> None:
    """Make ``reductions`` (bound to ``model``'s modules) what ``fxp_engine.inductor_sum_squares`` reads: at run time it
    finds its norm by the weight it is given, the module's own (the master in process, FSDP2's gathered parameter
    inside a unit's forward), so one graph Dynamo reuses for several layers still sums each layer's squares in its
    order. A module bound again replaces its old order."""
    modules = {id(model.get_submodule(r.module)): (model.get_submodule(r.module), r) for r in reductions if r.module is not None}
    _BOUND[:] = [(ref, r) for ref, r in _BOUND if ref() is not None and id(ref()) not in modules]
    _BOUND.extend((weakref.ref(module), r) for module, r in modules.values())


def _storage(tensor: object) -> int | None:
    """Where ``tensor``'s memory starts; None for what holds none here (a sharded DTensor between its unit's forwards,
    a parameter FSDP2 freed)."""
    if not isinstance(tensor, torch.Tensor) or (type(tensor) is not torch.Tensor and not isinstance(tensor, nn.Parameter)):
        return None
    try:
        return tensor.untyped_storage().data_ptr() or None
    except RuntimeError:
        return None


def reduction_of_weight(weight: torch.Tensor) -> NormReduction:
    """The bound order of the norm whose weight ``weight`` is (by storage: the same memory as the module's weight now)."""
    ptr = _storage(weight)
    found = {r for ref, r in _BOUND if (m := ref()) is not None and ptr is not None and _storage(getattr(m, "weight", None)) == ptr}
    if len(found) != 1:
        why = "no bound norm module holds it" if not found else f"{len(found)} bound norm modules share it"
        raise PrecisionError(
            f"fxp_engine.inductor_sum_squares: a norm weight of {weight.numel()} values whose engine order is not known ({why}): "
            "build the training side with fx_precision.training_side under the engine's contract"
        )
    return found.pop()
