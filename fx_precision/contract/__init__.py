"""The engine contract: what a rollout engine computes, op class by op class, so a training graph can compute it too.

    EngineContract (read off the engine by its adapter's probes on this machine; never assumed per ISA)
    ├── weights     gather bf16 from fp32 masters, compute bf16 (autocast)
    ├── norm        NormForm: fused-add (the norm after a residual add normalises the fp32 sum; the stream keeps
    │               the rounded sum: vLLM's fused_add_rms_norm) | plain (the model adds the residual itself)
    ├── rotary      RotaryOp: kernel (fp32 math, one store at ``rounding``) | native (torch forms) | none
    ├── attention   AttentionArithmetic: scores (amx | vec), exp (libm | fast512), lane sum (avx512 | avx2),
    │               P at bf16 or fp32, fused multiply-adds, the store's rounding; ``kv_tiling`` (KvTiling,
    │               contract/attention_tiles.py): where the engine placed each row's KV tiles (its L2, threads)
    ├── linears     LinearOrders: the order the engine's GEMM sums each linear's outputs in, per weight shape
    │               and rows per call, read at its thread count (contract/linear_order.py); the training
    │               side computes each row in its engine call's order (contract/batch_rows.py)
    ├── eager math  reductions (a norm's mean of squares) and transcendentals (exp, cos, sin, silu) by torch's
    │               eager kernels, as the engine runs them (always: Inductor sums and approximates otherwise), at the
    │               ATen CPU capability the engine's ran at (``eager_math``: AVX512, AVX2; the vector width decides
    │               a reduction's order), which the training process must run at too
    ├── moe         MoeKernel (contract/moe.py): the engine's router (top-k of the bf16 logits, softmax over them or
    │               exp(logit - logsumexp)) and its fused experts' arithmetic (FMA chains, its SiLU, the weighted
    │               combine in top-k order); None for a dense model
    ├── gdn         GdnForm (contract/gdn.py): how the engine computes its GatedDeltaNet layers (its kernel build, the
    │               SSM state's dtype, eps); the split of each sequence into prefilled pieces and decoded tokens is the
    │               dump's (batch_rows.gdn_pieces_of); None for a model without them, or unmatched says why
    ├── logits      LogitsForm (contract/logits.py): what the engine does to its logits after the GEMM (soft cap,
    │               scale: Granite's 1 / logits_scaling, one rounding of x * scale); None: not recorded
    ├── logprobs    LogprobForm: raw (fp32 log_softmax of the bf16 logits) | processed (of the logits / T, renormalised
    │               over what the request's top-k and top-p keep: logprobs.py)
    └── unmatched   the op classes the probes could not match, each with why: their value is None, and the
                    rewrite of a graph that has their pattern refuses with that reason (never a default)

Every field is typed on read (``from_dict``: wrong types, ranges and missing fields are one PrecisionError
naming the field), and ``check_evidence`` holds the contract to the evidence the probes recorded
(``contract/evidence.py``: a contract edited to a candidate the probe rejected is refused).

``passes/rewrites/engine`` rewrites a captured graph to follow it (any architecture whose graph has the
pattern); ``contract/ops.py`` holds the ops the rewrites call; the engine adapters (``fx_precision.engines``)
read it off their engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fx_precision.contract.attention_tiles import KvTiling
from fx_precision.contract.evidence import (
    CandidateEvidence,
    ContractEvidence,
    KeptValue,
    LogprobEvidence,
    linear_call_key,
    value_record,
    value_text,
)
from fx_precision.contract.gdn_form import GdnForm
from fx_precision.contract.inductor_norms import NormReduction
from fx_precision.contract.linear_order import LinearOrders
from fx_precision.contract.logits import LogitsForm
from fx_precision.contract.moe import MoeKernel
from fx_precision.contract.vocabulary import Exp, LaneSum, LogprobForm, NormForm, OpClass, RotaryForm, Rounding, Scores, parse_enum
from fx_precision.engine_description import EngineDescription
from fx_precision.errors import PrecisionError
from fx_precision.text_enum import TextEnum

if TYPE_CHECKING:
    from fx_precision.dump import Dump


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise PrecisionError(f"{where}={value!r}: true or false")
    return value


def _object(data: object, where: str, names: tuple[str, ...]) -> dict[str, Any]:
    """``data`` as a JSON object holding exactly ``names`` (missing or unknown fields: one error naming them)."""
    if not isinstance(data, dict):
        raise PrecisionError(f"{where}: a JSON object, got {type(data).__name__}")
    missing = [n for n in names if n not in data]
    unknown = sorted(set(data) - set(names))
    if missing or unknown:
        parts = [f"missing {', '.join(missing)}" if missing else "", f"unknown {', '.join(unknown)}" if unknown else ""]
        said = "; ".join(part for part in parts if part)
        raise PrecisionError(f"{where}: {said} (written by another fx_precision version? roll out again with this one)")
    return data


@dataclass(frozen=True)
class AttentionArithmetic:
    """One variant of the engine's CPU attention kernel (see ``contract/attention_kernels.cpp``)."""

    scores: Scores = Scores.AMX
    exp: Exp = Exp.LIBM
    reduce: LaneSum = LaneSum.AVX512
    p_bf16: bool = True  # probabilities rounded to bf16 before P.V (AMX)
    fma: bool = False  # fused multiply-adds in the fp32 dot products (vec)
    store: Rounding = Rounding.NEAREST_EVEN  # the output's bf16 store
    merge_fma: bool = True  # the KV tiles' rescale and the split-KV merge fused (AVX-512 builds), or multiply then add (AVX2)

    def __post_init__(self) -> None:
        for name, kind in (("scores", Scores), ("exp", Exp), ("reduce", LaneSum), ("store", Rounding)):
            object.__setattr__(self, name, parse_enum(kind, getattr(self, name), f"AttentionArithmetic.{name}"))
        for name in ("p_bf16", "fma", "merge_fma"):
            _bool(getattr(self, name), f"AttentionArithmetic.{name}")

    def describe(self) -> str:
        p = "bf16 P" if self.p_bf16 else "fp32 P"
        merge = "" if self.merge_fma else ", mul+add merge"
        dots = "fma" if self.fma else "mul+add"
        return f"{self.scores} scores, {self.exp} exp, {self.reduce} lane sum, {p}, {dots}, {self.store} store{merge}"

    def op_args(self) -> dict[str, Any]:
        """The named arguments of ``fxp_engine.attention`` that select this arithmetic."""
        return {"scores": str(self.scores), "exp": str(self.exp), "lane_sum": str(self.reduce), "p_bf16": self.p_bf16,
                "fma": self.fma, "store": str(self.store), "merge_fma": self.merge_fma}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"scores": str(self.scores), "exp": str(self.exp), "reduce": str(self.reduce), "p_bf16": self.p_bf16, "fma": self.fma,
                "store": str(self.store), "merge_fma": self.merge_fma}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.attention") -> AttentionArithmetic:
        if isinstance(data, dict) and "merge_fma" not in data:  # written before the field: fused, as it then computed
            data = {**data, "merge_fma": True}
        data = _object(data, where, ("scores", "exp", "reduce", "p_bf16", "fma", "store", "merge_fma"))
        try:
            return cls(**data)
        except PrecisionError as exc:
            raise PrecisionError(str(exc).replace("AttentionArithmetic.", f"{where}.")) from None


@dataclass(frozen=True)
class RotaryOp:
    """How the engine rotates q and k: its kernel (fp32 math from bf16 operands, one store at ``rounding``), torch's
    own forms, or no rotary at all."""

    form: RotaryForm = RotaryForm.KERNEL
    rounding: Rounding | None = Rounding.NEAREST_EVEN  # the kernel's store (kernel only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "form", parse_enum(RotaryForm, self.form, "RotaryOp.form"))
        if self.form == RotaryForm.KERNEL:
            object.__setattr__(self, "rounding", parse_enum(Rounding, self.rounding, "RotaryOp.rounding"))
        elif self.rounding is not None:
            raise PrecisionError(f"RotaryOp(form={self.form}): a rounding belongs to the kernel form only")

    def describe(self) -> str:
        return f"kernel, {self.rounding} store" if self.form == RotaryForm.KERNEL else str(self.form)

    def to_dict(self) -> dict[str, Any]:
        return {"form": str(self.form), "rounding": str(self.rounding) if self.rounding is not None else None}

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.rotary") -> RotaryOp:
        data = _object(data, where, ("form", "rounding"))
        try:
            return cls(**data)
        except PrecisionError as exc:
            raise PrecisionError(str(exc).replace("RotaryOp.", f"{where}.").replace("RotaryOp(", f"{where}(")) from None


_FIELDS = ("engine", "version", "norm", "rotary", "attention", "linears", "logprobs", "eager_math", "unmatched", "evidence")
# written by later versions only: a contract without kv_tiling takes one KV tile per row, one without moe read no experts,
# one without inductor is of the eager engine
_OPTIONAL = ("kv_tiling", "moe", "inductor", "norm_reductions", "gdn", "logits")


@dataclass(frozen=True)
class EngineContract:
    """What the training graph must compute to match the engine (module docstring). A ``None`` op class is one the
    probe could not match; ``unmatched`` says why."""

    engine: str = "vllm"
    version: str | None = None
    norm: NormForm | None = NormForm.FUSED_ADD
    rotary: RotaryOp | None = field(default_factory=RotaryOp)
    attention: AttentionArithmetic | None = field(default_factory=AttentionArithmetic)
    linears: LinearOrders = field(default_factory=LinearOrders)
    logprobs: LogprobForm | None = LogprobForm.RAW  # None: the probe matched no form (unmatched says why)
    eager_math: str | None = None  # the ATen CPU capability of the engine's eager kernels (None: not recorded, in-code contracts)
    unmatched: tuple[tuple[OpClass, str], ...] = ()
    evidence: ContractEvidence = field(default_factory=ContractEvidence)  # what each probe found (contract/evidence.py)
    kv_tiling: KvTiling | None = None  # where the engine's attention placed its KV tiles (None: one tile per row)
    moe: MoeKernel | None = None  # the engine's fused experts and router (None: a dense model, or unmatched says why)
    inductor: str | None = None  # the compiled engine's Inductor (contract/inductor_build.py; None: the eager engine)
    norm_reductions: tuple[NormReduction, ...] | None = None  # the compiled engine's norms' sums, in call order (inductor_norms.py)
    gdn: GdnForm | None = None  # the engine's GatedDeltaNet layers (None: none in the model, or unmatched says why)
    logits: LogitsForm | None = None  # what the engine does to its logits after the GEMM (None: not recorded, an older rollout)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, str) or not self.engine:
            raise PrecisionError(f"EngineContract.engine={self.engine!r}: the engine's name")
        if self.version is not None and not isinstance(self.version, str):
            raise PrecisionError(f"EngineContract.version={self.version!r}: a string or null")
        if self.norm is not None:
            object.__setattr__(self, "norm", parse_enum(NormForm, self.norm, "EngineContract.norm"))
        if self.rotary is not None and not isinstance(self.rotary, RotaryOp):
            raise PrecisionError(f"EngineContract.rotary: a RotaryOp, got {type(self.rotary).__name__}")
        if self.attention is not None and not isinstance(self.attention, AttentionArithmetic):
            raise PrecisionError(f"EngineContract.attention: an AttentionArithmetic, got {type(self.attention).__name__}")
        if not isinstance(self.linears, LinearOrders):
            raise PrecisionError(f"EngineContract.linears: LinearOrders, got {type(self.linears).__name__}")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", parse_enum(LogprobForm, self.logprobs, "EngineContract.logprobs"))
        if self.eager_math is not None and (not isinstance(self.eager_math, str) or not self.eager_math):
            raise PrecisionError(f"EngineContract.eager_math={self.eager_math!r}: the ATen CPU capability (e.g. AVX512) or null")
        unmatched = tuple((parse_enum(OpClass, c, "EngineContract.unmatched"), str(why)) for c, why in self.unmatched)
        object.__setattr__(self, "unmatched", unmatched)
        if not isinstance(self.evidence, ContractEvidence):
            raise PrecisionError(f"EngineContract.evidence: a ContractEvidence, got {type(self.evidence).__name__}")
        if self.kv_tiling is not None and not isinstance(self.kv_tiling, KvTiling):
            raise PrecisionError(f"EngineContract.kv_tiling: a KvTiling or None, got {type(self.kv_tiling).__name__}")
        if self.moe is not None and not isinstance(self.moe, MoeKernel):
            raise PrecisionError(f"EngineContract.moe: a MoeKernel or None, got {type(self.moe).__name__}")
        if self.inductor is not None and (not isinstance(self.inductor, str) or not self.inductor):
            raise PrecisionError(f"EngineContract.inductor={self.inductor!r}: the compiled engine's Inductor build (a string) or null")
        if self.logits is not None and not isinstance(self.logits, LogitsForm):
            raise PrecisionError(f"EngineContract.logits: a LogitsForm or None, got {type(self.logits).__name__}")
        if self.gdn is not None and not isinstance(self.gdn, GdnForm):
            raise PrecisionError(f"EngineContract.gdn: a GdnForm or None, got {type(self.gdn).__name__}")
        if self.norm_reductions is not None:
            if not isinstance(self.norm_reductions, tuple) or not all(isinstance(r, NormReduction) for r in self.norm_reductions):
                raise PrecisionError("EngineContract.norm_reductions: a tuple of NormReduction or None")
            if self.inductor is None:
                raise PrecisionError("EngineContract.norm_reductions: the compiled engine's norms, but EngineContract.inductor is null")
        missing = {OpClass.NORM: self.norm, OpClass.ROTARY: self.rotary, OpClass.ATTENTION: self.attention, OpClass.LOGPROBS: self.logprobs}
        for op_class, value in missing.items():
            if value is None and op_class not in self.why_unmatched():
                raise PrecisionError(f"EngineContract.{op_class}: none, and unmatched holds no reason (a probe matching nothing says why)")

    def why_unmatched(self) -> dict[OpClass, str]:
        return dict(self.unmatched)

    def refused(self, op_class: OpClass, where: str) -> PrecisionError:
        """The error of a rewrite that meets ``op_class``'s pattern while the probe matched nothing for it."""
        why = self.why_unmatched().get(op_class, "the probe matched no candidate")
        family = self.evidence.cpu_family
        ran = f" run as a {family} CPU" if family else ""
        return PrecisionError(
            f"engine contract ({self.engine} {self.version or ''}{ran}): {op_class} at {where or '<root>'}: the engine's {op_class} "
            f"matched no candidate the contract knows ({why}); the training graph cannot compute what the engine does there. Compare "
            "without --contract to see the gap, or roll out as the evidence suggests"
        )

    def describe(self) -> str:
        parts = [
            *([f"compiled by Inductor ({self.inductor})"] if self.inductor else []),
            *([f"norm sums in the engine's order ({_lanes(self.norm_reductions)})"] if self.norm_reductions else []),
            f"norm {self.norm or 'unmatched'}",
            f"rotary {self.rotary.describe() if self.rotary else 'unmatched'}",
            f"attention {self.attention.describe() if self.attention else 'unmatched'}"
            + (f" in the engine's KV tiles ({self.kv_tiling.describe()})" if self.kv_tiling and self.attention else ""),
            f"linears: {self.linears.describe()}",
            *([f"eager math at {self.eager_math}"] if self.eager_math else []),
            *([f"experts {self.moe.describe()}"] if self.moe is not None else []),
            *([f"GatedDeltaNet {self.gdn.describe()}"] if self.gdn is not None else []),
            *([f"logits {self.logits.describe()}"] if self.logits is not None and self.logits != LogitsForm() else []),
            f"log-probs {self.logprobs or 'unmatched'}",
        ]
        return f"{self.engine} {self.version or ''}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "version": self.version,
            "norm": str(self.norm) if self.norm is not None else None,
            "rotary": self.rotary.to_dict() if self.rotary is not None else None,
            "attention": self.attention.to_dict() if self.attention is not None else None,
            "linears": self.linears.to_dict(),
            "logprobs": str(self.logprobs) if self.logprobs is not None else None,
            "eager_math": self.eager_math,
            "unmatched": [[str(c), why] for c, why in self.unmatched],
            "evidence": self.evidence.to_dict(),
            "kv_tiling": self.kv_tiling.to_dict() if self.kv_tiling is not None else None,
            "moe": self.moe.to_dict() if self.moe is not None else None,
            "inductor": self.inductor,
            "norm_reductions": [r.to_dict() for r in self.norm_reductions] if self.norm_reductions is not None else None,
            "gdn": self.gdn.to_dict() if self.gdn is not None else None,
            "logits": self.logits.to_dict() if self.logits is not None else None,
        }

    @classmethod
    def from_dict(cls, data: object) -> EngineContract:
        data = _object(data, "contract", _FIELDS + tuple(n for n in _OPTIONAL if isinstance(data, dict) and n in data))
        unmatched = data["unmatched"]
        if not isinstance(unmatched, list) or any(
            not isinstance(u, list) or len(u) != 2 or not all(isinstance(x, str) for x in u) for u in unmatched
        ):
            raise PrecisionError(f"contract.unmatched: a list of [op class, why] pairs, got {unmatched!r}"[:300])
        try:
            return cls(
                engine=data["engine"],
                version=data["version"],
                norm=data["norm"],
                rotary=RotaryOp.from_dict(data["rotary"]) if data["rotary"] is not None else None,
                attention=AttentionArithmetic.from_dict(data["attention"]) if data["attention"] is not None else None,
                linears=LinearOrders.from_dict(data["linears"]),
                logprobs=data["logprobs"],
                eager_math=data["eager_math"],
                unmatched=tuple((c, why) for c, why in unmatched),
                evidence=ContractEvidence.from_dict(data["evidence"]),
                kv_tiling=KvTiling.from_dict(data["kv_tiling"]) if data.get("kv_tiling") is not None else None,
                moe=MoeKernel.from_dict(data["moe"]) if data.get("moe") is not None else None,
                inductor=data.get("inductor"),
                norm_reductions=_norm_reductions(data.get("norm_reductions")),
                gdn=GdnForm.from_dict(data["gdn"]) if data.get("gdn") is not None else None,
                logits=LogitsForm.from_dict(data["logits"]) if data.get("logits") is not None else None,
            )
        except PrecisionError as exc:
            raise PrecisionError(str(exc).replace("EngineContract.", "contract.")) from None

    def logprob_form(self, where: str = "the training side's log-probs") -> LogprobForm:
        """The log-probs the engine returned, or the refusal where the probe matched no form (never a default)."""
        if self.logprobs is None:
            raise self.refused(OpClass.LOGPROBS, where)
        return self.logprobs

    def with_attention(self, **changes: Any) -> EngineContract:
        if self.attention is None:
            raise PrecisionError("this contract's attention is unmatched: there is no arithmetic to change")
        return replace(self, attention=replace(self.attention, **changes))

    def check_evidence(self) -> None:
        """Refuse a contract its own evidence contradicts: every op class's value must be the one its probe kept, record
        for record (``evidence.<op class>.record``: the value's fields, never its description), a candidate with no
        mismatch; every linear call's order the one read."""
        probed: tuple[tuple[OpClass, KeptValue | TextEnum | None, CandidateEvidence | LogprobEvidence | None], ...] = (
            (OpClass.NORM, self.norm, self.evidence.norm),
            (OpClass.ROTARY, self.rotary, self.evidence.rotary),
            (OpClass.ATTENTION, self.attention, self.evidence.attention),
            (OpClass.GDN, self.gdn, self.evidence.gdn),
            (OpClass.LOGPROBS, self.logprobs, self.evidence.logprobs),
        )
        for op_class, value, found in probed:
            if value is None:
                continue
            if found is None or found.record is None:
                raise PrecisionError(f"contract.evidence.{op_class}: no record of what the probe kept; the contract cannot be checked "
                                     "(written by another fx_precision version? roll out again)")  # fmt: skip
            if found.record != value_record(value):
                raise PrecisionError(
                    f"contract.{op_class} is {value_text(value)!r}, but its probe kept {found.kept!r} (contract.evidence.{op_class}): "
                    "the contract is not the one its evidence supports; roll out again"
                )
        read = self.evidence.linears.read if self.evidence.linears is not None else {}
        for call in self.linears.calls:
            key = linear_call_key(call.out_features, call.in_features, call.rows)
            if read.get(key) != value_record(call.order):
                raise PrecisionError(
                    f"contract.linears: the call {key} is summed as {call.order.describe()!r}, its probe read another order "
                    f"({read.get(key)!r}, contract.evidence.linears.read): the contract is not the one its evidence supports; "
                    "roll out again"
                )


def contract_notes(contract: EngineContract, engine: EngineDescription, longest: int) -> list[str]:
    """What the contract does not follow in this engine run, each with what to do about it (empty: everything the
    run exercised was probed and matched). ``engine``: how the engine ran; ``longest``: the most keys a query row of
    the run saw (``attention_tiles.longest_row`` of the dump's engine record)."""
    notes = [f"the engine's {op_class} matched no candidate the contract knows ({why}): a graph with it is refused, "
             "compare without --contract to see the gap" for op_class, why in contract.unmatched]  # fmt: skip
    at_run = contract.evidence.attention.at_run if contract.evidence.attention is not None else None
    if at_run is not None and at_run.unmatched:
        notes.append(f"the engine's attention parts from the contract's at these calls of the run: {'; '.join(at_run.unmatched[:3])}")
        if engine.threads > 1 and engine.split_kv and contract.kv_tiling is None:
            notes.append(
                f"the engine ran split-KV attention on {engine.threads} threads (a decode row's keys split across threads, "
                "partial softmaxes merged), which a contract without a KV tiling does not follow: roll out again with this "
                "version, or with --split-kv off (or --threads 1)"
            )
    from fx_precision.contract.attention_tiles import smallest_kv_tile

    tile = smallest_kv_tile(engine.attention_isa, engine.l2_cache_bytes, engine.head_dim)
    if tile is not None and contract.attention is not None and contract.kv_tiling is None and longest > tile:
        notes.append(
            f"rows of this run see up to {longest} keys, more than the engine's smallest KV tile here ({tile} keys at head_dim "
            f"{engine.head_dim}, from its L2 of {engine.l2_cache_bytes} bytes), and this contract records no KV "
            "tiling (written before tiles were followed): where the engine took a row's keys in two tiles the contract's one "
            "pass parts from it; roll out again with this version (docs/engine-contract.md, KV tiles)"
        )
    if at_run is not None and at_run.checked < at_run.calls:
        notes.append(f"{at_run.checked} of the run's {at_run.calls} distinct attention calls were checked against the engine; "
                     "the rest were not: roll out fewer or shorter sequences per call to have every call checked")  # fmt: skip
    linears = contract.evidence.linears
    ambiguous = [k for k, v in linears.calls.items() if v.ambiguous] if linears is not None else []
    if ambiguous:
        notes.append(f"the probe could not tell two summation orders apart for {', '.join(ambiguous[:3])}: the first was kept")
    return notes


def _norm_reductions(data: object) -> tuple[NormReduction, ...] | None:
    if data is None:
        return None
    if not isinstance(data, list):
        raise PrecisionError(f"contract.norm_reductions: a list or null, got {type(data).__name__}")
    return tuple(NormReduction.from_dict(r) for r in data)


def _lanes(reductions: tuple[NormReduction, ...]) -> str:
    counts: dict[int, int] = {}
    for r in reductions:
        counts[r.lanes] = counts.get(r.lanes, 0) + 1
    return ", ".join(f"{n} at {lanes} lanes" for lanes, n in sorted(counts.items()))


def contract_of_dump(dump: Dump) -> EngineContract:
    """The contract an engine's dump recorded (``fx-precision rollout`` probes and writes it), held to its evidence."""
    data = getattr(dump, "contract", None)
    if not data:
        raise PrecisionError(
            f"dump {getattr(dump, 'source', dump)} records no engine contract; write the rollout with fx-precision rollout, "
            "which probes the engine"
        )
    contract = EngineContract.from_dict(data)
    contract.check_evidence()
    compiled = EngineDescription.of_run(getattr(dump, "engine", None)).compiled
    if compiled and contract.inductor is None:  # refused before any model is built: not followed, said why
        why = contract.why_unmatched().get(OpClass.NORM, "the engine ran compiled and the rollout read no Inductor build")
        raise PrecisionError(f"dump {getattr(dump, 'source', dump)}: engine contract: {why}")
    return contract


__all__ = ["AttentionArithmetic", "EngineContract", "RotaryOp", "contract_notes", "contract_of_dump"]
