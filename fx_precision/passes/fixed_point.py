"""Fixing sources to a fixed point: a propagation can hide a source until its upstream is fixed.

A Llama-style norm, ``weight * h.to(input_dtype)``, is a mere propagation while ``h`` arrives
fp32 (the embedding's leak); once the embedding's output is cast, ``h`` is bf16 and the same
multiply promotes it with the fp32 weight: a *masked source*. So is transformers' KV-cache
``cat`` with its empty fp32 placeholder. One analysis round cannot see them::

    round 0   embedding -> fp32 ──▶ norm: weight * h -> fp32 (propagation) ──▶ residual + ... fp32
              cast: embedding.to(bf16)
    round 1   embedding -> bf16 ──▶ norm: weight * h -> fp32 (SOURCE, masked by round 0's embedding)
              cast: (weight * h).to(bf16)
    round 2   no new source: the fixed point; what remains is what enforce judges

Each round casts the sources it found, re-propagates dtypes (retargeting the dtype-following
casts the narrowing invalidated) and analyses again. The converse happens too: Dynamo traces
RoPE's ``cos.to(dtype=x.dtype)`` as ``.to(fp32)`` while the embedding leaks, so ``k * cos`` looks
like a promotion source in round 0; once the retarget makes ``cos`` narrow, the cast that fixed
``k * cos`` is a no-op. A source whose every fixing cast ended a no-op is an *artefact* of the
leak: at the fixed point its finding is dropped, its casts removed, and the findings it seemed to
mask are attributed to the real sources of its round. A source that surfaces in round k records
``round=k`` and ``masked_by``: the earlier-round sources its value came from. Every round casts
at least one node and a cast source is contained afterwards, so the loop ends; ``MAX_ROUNDS``
bounds it anyway. ``pipeline.run_pipeline`` runs it as its second and third steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import fx

from fx_precision.errors import PrecisionError
from fx_precision.module_graph import module_label
from fx_precision.passes.analysis import GraphAnalysis, settle_rewrite
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind
from fx_precision.passes.rewrites.source_casts import cast_sources
from fx_precision.passes.rules.findings import Finding

if TYPE_CHECKING:
    from fx_precision.passes.context import PassContext

MAX_ROUNDS = 32


@dataclass
class FixedPoint:
    """The outcome of ``fix_sources`` on one graph.

    ``findings``: round 0's findings (the graph as traced) followed by every finding that surfaced
    in a later round, each marked with its round and what masked it. ``final``: the analysis at
    the fixed point (what remains after every cast). ``rounds``: how many rounds inserted casts.
    """

    first: GraphAnalysis
    final: GraphAnalysis
    findings: list[Finding]
    casts: list[InsertedCast] = field(default_factory=list)
    rounds: int = 0

    @property
    def sources(self) -> list[Finding]:
        return [f for f in self.findings if f.is_source]


def fix_sources(gm: fx.GraphModule, first: GraphAnalysis, ctx: PassContext, max_rounds: int = MAX_ROUNDS) -> FixedPoint:
    """Cast ``first``'s sources in ``gm`` (``first`` analysed ``gm`` itself), re-analyse with
    ``ctx``, repeat until no new source appears. ``ctx.compute=None``: nothing to cast."""
    result = FixedPoint(first, first, list(first.findings), [*first.gather_casts, *first.retargeted])
    compute = ctx.compute
    if compute is None:
        return result
    seen = {(f.code, f.node) for f in first.findings}
    current = first
    while True:
        pending = current.sources
        if not pending:
            break
        if result.rounds >= max_rounds:
            names = ", ".join(f"{f.code} at {module_label(f.module)} (node {f.node})" for f in pending[:5])
            raise PrecisionError(
                f"graph {first.index}: sources still appear after {max_rounds} rounds of casts ({names}); the pass cannot "
                "converge on this graph. Report the model, and meanwhile cast these outputs to the compute dtype in the model."
            )
        inserted = cast_sources(current.annotation, pending, compute)
        if not inserted:
            break  # sources whose value cannot be cast at their op: enforce reports them
        result.casts += inserted + settle_rewrite(gm, inserted, compute, ctx.device_type, before=current.annotation)
        result.rounds += 1
        previous, current = current, ctx.analyse(gm)
        result.final = current
        masking = {f.node for f in pending}
        for finding in current.findings:
            if (finding.code, finding.node) in seen:
                continue
            seen.add((finding.code, finding.node))
            traced = previous.annotation.get(finding.node)
            masked_by = tuple(sorted(masking & traced.origin)) if traced is not None else ()
            result.findings.append(replace(finding, round=result.rounds, masked_by=masked_by))
    return result


class _Fixed(Protocol):
    final: GraphAnalysis
    findings: list[Finding]
    casts: list[InsertedCast]

    @property
    def sources(self) -> list[Finding]: ...


def drop_artefacts(gm: fx.GraphModule, result: _Fixed, compute: torch.dtype) -> None:
    """Remove the sources that upstream fixes made narrow by themselves (see the module docstring)."""
    final = result.final.annotation
    fixing: dict[str, list[InsertedCast]] = {}
    for cast in result.casts:
        if cast.kind in (CastKind.SOURCE_OUTPUT, CastKind.SOURCE_OPERAND) and cast.fixes is not None:
            fixing.setdefault(cast.fixes, []).append(cast)
    artefacts: dict[str, int] = {}
    for finding in result.sources:
        casts = fixing.get(finding.node, [])
        subjects = [final.get(c.of) for c in casts]
        if casts and all(s is not None and s.dtype is not None and s.dtype.itemsize <= compute.itemsize for s in subjects):
            artefacts[finding.node] = finding.round  # every cast that fixed it ended a no-op
    if not artefacts:
        return
    real_by_round: dict[int, set[str]] = {}
    for finding in result.sources:
        if finding.node not in artefacts:
            real_by_round.setdefault(finding.round, set()).add(finding.node)
    kept = []
    for finding in result.findings:
        if finding.node in artefacts and finding.is_source:
            continue
        if any(name in artefacts for name in finding.masked_by):
            names: set[str] = set()
            for name in finding.masked_by:
                names |= real_by_round.get(artefacts[name], set()) if name in artefacts else {name}
            finding = replace(finding, masked_by=tuple(sorted(names)))
        kept.append(finding)
    result.findings = kept
    nodes = {n.name: n for n in gm.graph.nodes}
    for cast in [c for c in result.casts if c.fixes in artefacts and c.node in nodes]:
        node = nodes[cast.node]
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        final.forget(node)
    result.casts = [c for c in result.casts if c.fixes not in artefacts]
    gm.recompile()
