"""The evidence a contract rests on: what each probe tried on the engine, what it kept, and why, typed.

Written by an engine adapter's probes (``contract/probing.py``, called by ``engines/vllm/session.py``), read by
the core (``EngineContract.check_evidence``, ``contract_notes``, ``EngineContract.refused``) and the CLI::

    ContractEvidence
    ├── attention_isa, kernels, cpu_family   how the probed engine ran (its attention ISA, kernel build, CPU family)
    ├── rotary, norm, eager_math             CandidateEvidence: each candidate's mismatch count, the one ``kept``
    │                                        (its ``describe()``), or ``why`` none was; ``failed``: the probe could
    │                                        not run here
    ├── attention                            AttentionEvidence: the candidates at prefill, narrowed by decode rows,
    │                                        separating probes and rounds; ``at_run``: RunCallsChecked, the kept
    │                                        arithmetic against the engine at the run's own calls
    ├── linears                              LinearEvidence: every call's LinearCallEvidence, the order ``read`` per
    │                                        "N x K at rows", the calls no order matched
    ├── logprobs                             LogprobEvidence: the step read, the sampler's settings, the rows each
    │                                        form gave, the form kept
    └── gdn                                  CandidateEvidence: the GatedDeltaNet kernels against the contract's

An op class the probes never reached is ``None``. ``followed()`` is the one reading of "the contract follows the
engine here" (the CLI's "probes matched", the benchmark tables); ``to_dict`` writes it beside the evidence for
readers of the JSON, and ``from_dict`` refuses a file whose record of it its own evidence contradicts. Every
field is typed on read: a wrong type or an unknown or missing field is one PrecisionError naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from fx_precision.errors import PrecisionError

E = TypeVar("E", bound="Evidence")


class Evidence:
    """JSON in and out by the dataclass's own field types (str, int, float, bool, None, dict[str, X], tuple[X, ...],
    list[X] and nested Evidence), so every evidence class states its fields once."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[E], data: object, where: str) -> E:
        if not isinstance(data, dict):
            raise PrecisionError(f"{where}: a JSON object, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise PrecisionError(f"{where}: unknown {', '.join(unknown)} (written by another fx_precision version? roll out again)")
        values = {name: _from_json(hints[name], data[name], f"{where}.{name}") for name in names if name in data}
        try:
            return cls(**values)
        except TypeError as exc:  # a field without a default missing
            raise PrecisionError(f"{where}: {exc}") from None


def _to_json(value: Any) -> Any:
    if isinstance(value, Evidence):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return value


def _from_json(kind: Any, value: Any, where: str) -> Any:
    """``value`` read as ``kind`` (a resolved type hint), or one error naming ``where``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_json(inner, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise PrecisionError(f"{where}: a JSON object, got {type(value).__name__}")
        return {str(k): _from_json(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise PrecisionError(f"{where}: a JSON list, got {type(value).__name__}")
        items = [_from_json(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if kind is Any:
        return value
    if isinstance(kind, type) and issubclass(kind, Evidence):
        return kind.from_dict(value, where)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PrecisionError(f"{where}={value!r}: a {kind.__name__}"[:300])
    return value


@dataclass(frozen=True)
class CandidateEvidence(Evidence):
    """One op class's probe: every candidate's mismatch count against the engine, the one kept (its ``describe()``),
    or why none was; ``failed``: the probe itself could not run here (a candidate this CPU cannot execute, an engine
    op that refused the probe's shapes); ``details``: what the probe read besides (the module it found, its calls)."""

    candidates: dict[str, int] = field(default_factory=dict)
    kept: str | None = None
    why: str | None = None
    failed: bool = False
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunCallsChecked(Evidence):
    """The kept attention arithmetic against the engine at the calls the run made: how many distinct calls it made,
    how many were checked, and each call whose rows part (its requests and the rows that differ)."""

    calls: int = 0
    checked: int = 0
    unmatched: tuple[str, ...] = ()


@dataclass(frozen=True)
class AttentionEvidence(CandidateEvidence):
    """The attention probe: candidates at prefill; ``decode``: why no candidate gives a lone decode row (if none
    did); the separating probe's and further rounds' counts where two candidates remained; ``ambiguous``: how many
    were left indistinguishable (the first kept); ``not_tried``: candidates this CPU cannot run, with why;
    ``at_run``: the run's own calls checked."""

    not_tried: dict[str, str] = field(default_factory=dict)
    decode: str | None = None
    separating: dict[str, int] = field(default_factory=dict)
    separating_rounds: tuple[dict[str, int], ...] = ()
    ambiguous: int = 0
    at_run: RunCallsChecked | None = None

    def followed(self) -> bool:
        """Whether the kept arithmetic gives the engine's attention: the run's own calls decide where they were
        checked (a lone probe's decode row may split its keys across threads where the run's batched steps do not)."""
        if self.kept is None:
            return False
        if self.at_run is not None:
            return not self.at_run.unmatched
        return self.decode is None


@dataclass(frozen=True)
class LinearCallEvidence(Evidence):
    """One linear call's order read at ``rows``: the outputs probed, the orders left, the one kept (or why none)."""

    rows: int = 0
    probed_outputs: int = 0
    candidates_left: int = 0
    not_tried: dict[str, str] = field(default_factory=dict)
    ambiguous: tuple[str, ...] = ()
    kept: str | None = None
    why: str | None = None


def linear_call_key(out_features: int, in_features: int, rows: int) -> str:
    """How ``LinearEvidence.read`` names one linear call: its weight shape and the rows it held."""
    return f"{out_features}x{in_features} at {rows} rows"


@dataclass(frozen=True)
class LinearEvidence(Evidence):
    """Every linear call the run made: ``calls`` ("name N x K at rows" -> its reading), ``read`` ("N x K at rows" ->
    the order kept, what the contract's LinearOrders must hold), the calls no order matched and why."""

    calls: dict[str, LinearCallEvidence] = field(default_factory=dict)
    read: dict[str, str] = field(default_factory=dict)
    unmatched: tuple[str, ...] = ()
    why: str | None = None
    failed: bool = False

    def followed(self) -> bool:
        return not self.unmatched and not self.failed


@dataclass(frozen=True)
class LogprobEvidence(Evidence):
    """The log-prob probe: the step whose logits were read, the sampler's settings there, the logits rows and the
    sampled tokens at the step, how many rows each form gave bit for bit, the form kept (or why none), and the mode
    the engine was asked for."""

    step: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logits_rows: int = 0
    sampled_tokens: int = 0
    rows_given: dict[str, int] = field(default_factory=dict)
    kept: str | None = None
    why: str | None = None
    mode: str | None = None


@dataclass(frozen=True)
class ContractEvidence(Evidence):
    """What every probe of one engine found (module docstring)."""

    attention_isa: str | None = None
    kernels: str | None = None
    cpu_family: str | None = None
    rotary: CandidateEvidence | None = None
    norm: CandidateEvidence | None = None
    eager_math: CandidateEvidence | None = None
    attention: AttentionEvidence | None = None
    linears: LinearEvidence | None = None
    logprobs: LogprobEvidence | None = None
    gdn: CandidateEvidence | None = None  # the GatedDeltaNet kernels (engines/vllm/gdn_probe.py); None: no such layer

    def followed(self) -> dict[str, bool]:
        """Per op class between the GEMMs and at them: does the contract follow the engine (the probe kept a candidate
        and, for attention and the linears, the run's own calls held)."""
        return {
            "rotary": self.rotary is not None and self.rotary.kept is not None,
            "norm": self.norm is not None and self.norm.kept is not None,
            "attention": self.attention is not None and self.attention.followed(),
            "linears": self.linears is not None and self.linears.followed(),
        }

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "matched": self.followed()}

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.evidence") -> ContractEvidence:
        if not isinstance(data, dict):
            raise PrecisionError(f"{where}: a JSON object, got {type(data).__name__}")
        recorded = data.get("matched")
        evidence = super().from_dict({k: v for k, v in data.items() if k != "matched"}, where)
        if recorded is not None and recorded != evidence.followed():
            raise PrecisionError(
                f"{where}.matched={recorded!r}, but the evidence gives {evidence.followed()!r}: the file is not what its probes "
                "found; roll out again"
            )
        return evidence


__all__ = [
    "AttentionEvidence",
    "CandidateEvidence",
    "ContractEvidence",
    "LinearCallEvidence",
    "LinearEvidence",
    "LogprobEvidence",
    "RunCallsChecked",
    "linear_call_key",
]
