"""The vocabularies of the analysis: what a node is, how bad a finding is, why a cast was inserted.

Each is a ``TextEnum``: it compares equal to, formats as and serialises to its value
(``Severity.ERROR == "error"``), so reports, JSON and ``--fail-on error`` read as before.

    NodeKind     weight | constant | input | compute | intentional | source | propagation | other
    Severity     info < warn < error
    FindingKind  uncovered-op | weight-promotion (sources) | explicit-upcast | wide-input | round-trip-cast
                 | plan-mismatch | wide-gather
    CastKind     gather-emulation | source-output | source-operand | weight-read | dtype-following | covered-narrowing
                 | engine-contract
    ParamKind    parameter | buffer (what a lifted placeholder holds)
"""

from __future__ import annotations

from collections.abc import Iterable

from fx_precision.text_enum import TextEnum as _TextEnum


class NodeKind(_TextEnum):
    """What a float node of a graph is, for the precision contract (see ``annotate``)."""

    WEIGHT = "weight"  # a parameter or buffer, or computed from them (and constants) alone
    CONSTANT = "constant"  # a factory (arange, zeros, tensor), a lifted Python number, or computed from those alone
    INPUT = "input"  # a graph input that is not a parameter
    COMPUTE = "compute"  # not wider than the compute dtype
    INTENTIONAL = "intentional"  # wide because the program asked (x.float(), an op autocast runs in fp32)
    SOURCE = "source"  # wide without the program asking: the leak starts here
    PROPAGATION = "propagation"  # wide because an activation input is wide (type_as, residual adds)
    OTHER = "other"  # not a float tensor

    @property
    def is_static(self) -> bool:
        """Weights and constants: values that do not depend on the batch."""
        return self in (NodeKind.WEIGHT, NodeKind.CONSTANT)


class Severity(_TextEnum):
    INFO = "info"
    WARN = "warn"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _SEVERITY_ORDER.index(self)

    @classmethod
    def worst(cls, severities: Iterable[Severity]) -> Severity | None:
        return max(severities, key=lambda s: s.rank, default=None)


_SEVERITY_ORDER = (Severity.INFO, Severity.WARN, Severity.ERROR)


def severity_rank(severity: str | Severity | None) -> int:
    """-1 for no severity; ``"warn"`` and ``Severity.WARN`` rank alike."""
    return -1 if severity is None else Severity(severity).rank


class CastKind(_TextEnum):
    """Why the pass cast something."""

    GATHER = "gather-emulation"  # a parameter to its unit's gather dtype, at its use
    SOURCE_OUTPUT = "source-output"  # a source's output to the compute dtype
    SOURCE_OPERAND = "source-operand"  # a promotion's module-crossing operand, for that use
    WEIGHT_READ = "weight-read"  # a parameter an uncovered one-dtype op reads (grouped_mm), for that use
    RETARGET = "dtype-following"  # a traced cast / factory dtype that followed a narrowed value
    COVERED = "covered-narrowing"  # a wide tensor only autocast-covered ops use, at its producer
    ENGINE = "engine-contract"  # an op rewritten to compute what the rollout engine computes


class FindingKind(_TextEnum):
    """What a lint finding is (its FXP code in ``rules/findings.CODES``)."""

    UNCOVERED = "uncovered-op"  # source: an op autocast does not cover ran on a wide input
    PROMOTION = "weight-promotion"  # source: an elementwise op of a wide weight and a compute activation
    EXPLICIT_UPCAST = "explicit-upcast"
    WIDE_INPUT = "wide-input"
    ROUND_TRIP = "round-trip-cast"
    PLAN_MISMATCH = "plan-mismatch"
    WIDE_GATHER = "wide-gather"
    ENGINE_UNFOLLOWED = "engine-unfollowed"  # under an engine contract: an op the engine runs with a kernel not followed

    @property
    def is_source(self) -> bool:
        return self in (FindingKind.UNCOVERED, FindingKind.PROMOTION)


class ParamKind(_TextEnum):
    """What a lifted placeholder holds."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
