"""The engine contract's vocabularies: typed in code, read and written as their text (``TextEnum``).

OpClass       the contract's op classes, in the order the rewrites apply (passes/rewrites/engine)
Rounding      how a kernel stores fp32 as bf16
NormForm      what the norm after a residual add normalises
RotaryForm    how the engine rotates q and k
Scores, Exp, LaneSum    the attention kernel's instruction, exp and softmax-sum reduction
LogprobForm   which log-probs the engine returns: of the raw logits, or of the logits at the temperature
MOE_EXPS, MOE_STORES, MOE_COMBINES    the fused experts' forms per kernel build (contract/moe.py; kernels.MOE_FORMS)
"""

from __future__ import annotations

from typing import Any, TypeVar

from fx_precision.errors import PrecisionError
from fx_precision.text_enum import TextEnum


class OpClass(TextEnum):
    NORM = "norm"
    ROTARY = "rotary"
    ATTENTION = "attention"
    LINEARS = "linears"
    EAGER_MATH = "eager-math"
    LOGPROBS = "logprobs"
    MOE = "moe"
    GDN = "gdn"


class Rounding(TextEnum):
    NEAREST_EVEN = "nearest-even"
    TRUNCATE = "truncate"

    @property
    def code(self) -> int:
        """The kernels' code for it (attention_kernels.cpp ``Store``, in engine_kernels.h)."""
        return 0 if self is Rounding.NEAREST_EVEN else 1


class NormForm(TextEnum):
    FUSED_ADD = "fused-add"  # the fp32 sum of the residual add (vLLM's fused_add_rms_norm); the stream keeps its rounding
    PLAIN = "plain"  # the sum the model rounded itself (Granite's residual multiplier)
    INDUCTOR = "inductor"  # the compiled engine: the residual stream kept fp32, the norm's product stored once (Inductor's fusion)
    INDUCTOR_STREAM = "inductor-stream"  # the same where the model adds its residual itself (Granite): its bf16 chain kept
    # fp32 by Inductor, rounded where a norm's kernel stores it (contract.norm_reductions: stores, summed)


class RotaryForm(TextEnum):
    KERNEL = "kernel"  # fp32 math from bf16 operands, one store at the kernel's rounding
    NATIVE = "native"  # torch's forms, as transformers writes them: nothing to rewrite
    NONE = "none"  # the model has no rotary
    INDUCTOR = "inductor"  # the compiled engine: fp32 math of the unrounded q / k norm output, one nearest-even store


class Scores(TextEnum):
    AMX = "amx"  # bf16 dot products on AMX tiles, then * scale
    VEC = "vec"  # q * scale in fp32 first, vector dot products


class Exp(TextEnum):
    LIBM = "libm"  # glibc expf
    FAST512 = "fast512"  # the engine's AVX-512 polynomial


class LaneSum(TextEnum):
    AVX512 = "avx512"  # the 16 lanes halved, then halved again
    AVX2 = "avx2"  # lanes 0-7 and 8-15 each from 0, then added


class LogprobForm(TextEnum):
    RAW = "raw"  # fp32 log_softmax of the bf16 logits; the sampling temperature does not enter (vLLM's default)
    PROCESSED = "processed"  # fp32 log_softmax of the fp32 logits / T over what top-k / top-p keep (what the sampler drew from)


MOE_EXPS = ("fast512", "sleef")  # SiLU's exp: the AVX-512 polynomial (the AVX-512 builds), SLEEF's expf (the AVX2 build)
MOE_STORES = ("nearest-even", "truncate")  # bf16 stores: VCVTNEPS2BF16 (AVX-512 BF16), or the upper half (builds without)
MOE_COMBINES = ("fma", "mul+add")  # the slots' weighted sum: FMAs, or multiply then add (a build without FMA contraction)

E = TypeVar("E", bound=TextEnum)


def parse_enum(kind: type[E], value: Any, where: str) -> E:
    """``value`` as a member of ``kind``: its text, or the member itself; anything else is one error naming ``where``."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise PrecisionError(f"{where}={value!r}: one of {', '.join(m.value for m in kind)}")
