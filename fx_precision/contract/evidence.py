"""The evidence a contract rests on: what each probe tried on the engine, what it kept, and why, typed.

Written by an engine adapter's probes (``contract/probing.py``, called by ``engines/vllm/session.py``), read by
the core (``EngineContract.check_evidence``, ``contract_notes``, ``EngineContract.refused``) and the CLI::

    ContractEvidence
    ├── attention_isa, kernels, cpu_family   how the probed engine ran (its attention ISA, kernel build, CPU family)
    ├── rotary, norm, eager_math             CandidateEvidence: each candidate's mismatch count, the one ``kept``
    │                                        (its ``describe()``; its ``record``, its fields, which the contract's
    │                                        value is checked against), or ``why`` none was; ``failed``: the probe
    │                                        could not run here
    ├── attention                            AttentionEvidence: the candidates at prefill, narrowed by decode rows,
    │                                        separating probes and rounds; ``at_run``: RunCallsChecked, the kept
    │                                        arithmetic against the engine at the run's own calls
    ├── linears                              LinearEvidence: every call's LinearCallEvidence, the order ``read`` per
    │                                        "N x K at rows" (a record), the calls no order matched
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
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fx_precision.errors import PrecisionError
from fx_precision.json_record import JsonRecord
from fx_precision.text_enum import TextEnum


class Evidence(JsonRecord):
    """Every evidence class: a dataclass read and written by its own field types (json_record.py)."""


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
    record: dict[str, Any] | None = None  # the kept value's record (``value_record``): what the contract is checked by


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
    record: dict[str, Any] | None = None


def linear_call_key(out_features: int, in_features: int, rows: int) -> str:
    """How ``LinearEvidence.read`` names one linear call: its weight shape and the rows it held."""
    return f"{out_features}x{in_features} at {rows} rows"


@dataclass(frozen=True)
class LinearEvidence(Evidence):
    """Every linear call the run made: ``calls`` ("name N x K at rows" -> its reading), ``read`` ("N x K at rows" ->
    the record of the order kept, what the contract's LinearOrders must hold), the calls no order matched and why."""

    calls: dict[str, LinearCallEvidence] = field(default_factory=dict)
    read: dict[str, dict[str, Any]] = field(default_factory=dict)
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
    record: dict[str, Any] | None = None


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


class KeptValue(Protocol):
    """A value a probe keeps (a rotary, attention, GDN form, a linear order): described for a reader, recorded for a check."""

    def describe(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def value_record(value: KeptValue | TextEnum) -> dict[str, Any]:
    """The record of a value a probe kept, what the contract's value is checked against (field by field, never by its
    description): its own ``to_dict()``, or ``{"form": name}`` for a form that is a name alone (a norm, a log-prob form)."""
    return {"form": str(value)} if isinstance(value, TextEnum) else value.to_dict()


def value_text(value: KeptValue | TextEnum) -> str:
    """How a reader sees the value kept (``kept``)."""
    return str(value) if isinstance(value, TextEnum) else value.describe()


Keeping = TypeVar("Keeping", bound=CandidateEvidence | LinearCallEvidence | LogprobEvidence)


def keeping(evidence: Keeping, value: KeptValue | TextEnum) -> Keeping:
    """``evidence`` with ``value`` kept: its description (``kept``) and its record (``record``)."""
    return dataclasses.replace(evidence, kept=value_text(value), record=value_record(value))


__all__ = [
    "AttentionEvidence",
    "CandidateEvidence",
    "ContractEvidence",
    "KeptValue",
    "LinearCallEvidence",
    "LinearEvidence",
    "LogprobEvidence",
    "RunCallsChecked",
    "keeping",
    "linear_call_key",
    "value_record",
    "value_text",
]
