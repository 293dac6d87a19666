"""The engine contract: what a rollout engine computes, op class by op class, so a training graph can compute it too.

    EngineContract (detected by probing the engine's own ops on this machine; never assumed per ISA)
    ├── weights     gather bf16 from fp32 masters, compute bf16 (autocast)
    ├── norm        fused-add: the norm after a residual add normalises the fp32 sum; the stream
    │               keeps the rounded sum (vLLM's fused_add_rms_norm) | plain: the model adds the
    │               residual itself and the norm sees the rounded sum (Granite's residual multiplier)
    ├── rotary      kernel (fp32 math, one store, ``rounding``) | native (torch forms: bit-identical to
    │               transformers' apply_rotary_pos_emb, nothing to rewrite)
    ├── attention   AttentionArithmetic: scores (amx | vec), exp (libm | fast512), lane reduction
    │               (avx512 | avx2), P at bf16 or fp32, fused multiply-adds, the store's rounding
    ├── linears     LinearOrders: the order the engine's GEMM sums each linear's outputs in, per weight shape
    │               and rows per call, read at its thread count (contract/linear_order.py); the training
    │               side computes each row in its engine call's order (contract/batch_rows.py)
    ├── rounding    nearest-even | truncate: how the engine's kernels store fp32 as bf16
    ├── eager math  reductions (a norm's mean of squares) and transcendentals (exp, cos, sin, silu)
    │               by torch's eager kernels, as the engine runs them: Inductor would sum in another
    │               order and approximate otherwise
    └── logprobs    fp32 log_softmax of bf16 logits (what vLLM's sampler returns)

``passes/rewrites/engine.py`` rewrites a captured graph to follow it (any architecture whose graph
has the pattern); ``contract/ops.py`` holds the ops the rewrites call; ``contract/probe.py`` finds it
in the engine's process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fx_precision.contract.linear_order import LinearOrders
from fx_precision.errors import PrecisionError

ROUNDINGS = ("nearest-even", "truncate")
ROTARIES = ("kernel", "native")


@dataclass(frozen=True)
class AttentionArithmetic:
    """One variant of the engine's CPU attention kernel (see ``contract/engine_kernels.cpp``)."""

    scores: str = "amx"  # "amx": bf16 dot products, then * scale | "vec": q * scale in fp32 first
    exp: str = "libm"  # "libm": glibc expf | "fast512": the AVX-512 polynomial
    reduce: str = "avx512"  # lane reduction of the softmax sum: "avx512" (halving tree) | "avx2" (two sequential halves)
    p_bf16: bool = True  # probabilities rounded to bf16 before P.V (AMX)
    fma: bool = False  # fused multiply-adds in the fp32 dot products (vec)
    store: str = "nearest-even"  # the output's bf16 store: "nearest-even" | "truncate"

    def __post_init__(self) -> None:
        checks = {"scores": ("amx", "vec"), "exp": ("libm", "fast512"), "reduce": ("avx512", "avx2"), "store": ROUNDINGS}
        for name, allowed in checks.items():
            if getattr(self, name) not in allowed:
                raise PrecisionError(f"AttentionArithmetic.{name}={getattr(self, name)!r}: one of {', '.join(allowed)}")

    def describe(self) -> str:
        p = "bf16 P" if self.p_bf16 else "fp32 P"
        return f"{self.scores} scores, {self.exp} exp, {self.reduce} lane sum, {p}, {'fma' if self.fma else 'mul+add'}, {self.store} store"


@dataclass(frozen=True)
class EngineContract:
    """What the training graph must compute to match the engine (module docstring)."""

    engine: str = "vllm"
    version: str | None = None
    rounding: str = "nearest-even"
    rotary: str = "kernel"
    norm: str = "fused-add"
    attention: AttentionArithmetic = field(default_factory=AttentionArithmetic)
    linears: LinearOrders = field(default_factory=LinearOrders)
    logprobs: str = "fp32-log-softmax-of-bf16-logits"
    evidence: dict[str, Any] = field(default_factory=dict)  # what each probe found: candidates and their mismatches

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise PrecisionError(f"EngineContract.rounding={self.rounding!r}: one of {', '.join(ROUNDINGS)}")
        if self.rotary not in ROTARIES:
            raise PrecisionError(f"EngineContract.rotary={self.rotary!r}: one of {', '.join(ROTARIES)}")
        if self.norm not in ("fused-add", "plain"):
            raise PrecisionError(f"EngineContract.norm={self.norm!r}: 'fused-add' (vLLM) or 'plain'")

    def describe(self) -> str:
        return (
            f"{self.engine} {self.version or ''}: norm {self.norm}; rotary {self.rotary}; "
            f"attention {self.attention.describe()}; linears: {self.linears.describe()}; stores {self.rounding}"
        ).replace("  ", " ")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["linears"] = self.linears.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineContract:
        if not isinstance(data, dict):
            raise PrecisionError(f"an engine contract is a JSON object, got {type(data).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PrecisionError(f"engine contract: unknown field(s) {', '.join(unknown)}; written by a newer fx_precision?")
        attention = data.get("attention") or {}
        linears = LinearOrders.from_dict(data["linears"]) if "linears" in data else LinearOrders()
        try:
            return cls(**{**data, "attention": AttentionArithmetic(**attention), "linears": linears})
        except TypeError as exc:
            raise PrecisionError(f"engine contract: {exc}") from None

    def with_attention(self, **changes: Any) -> EngineContract:
        return replace(self, attention=replace(self.attention, **changes))


def contract_of_dump(dump: Any) -> EngineContract:
    """The contract an engine's dump recorded (``fx-precision rollout`` probes and writes it)."""
    data = getattr(dump, "contract", None)
    if not data:
        raise PrecisionError(
            f"dump {getattr(dump, 'source', dump)} records no engine contract; write the rollout with fx-precision rollout, "
            "which probes the engine"
        )
    return EngineContract.from_dict(data)
