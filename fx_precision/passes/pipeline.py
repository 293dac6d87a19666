"""The pass pipeline: one function lists every pass in order, for lint (report) and the backend (rewrite).

    run_pipeline(gm, ctx, mode)
    1. analyse          annotate dtypes, units and parameters; emulate gathers (plan, one device);
                        findings and census of the graph as traced                    (analysis.py)
    2. fix sources      cast each source's output, retarget dtype-following casts, re-analyse,
                        until no new source surfaces (masked sources)                 (fixed_point.py)
    3. drop artefacts   sources that upstream fixes made narrow by themselves         (fixed_point.py)
    4. narrow covered   wide module-crossing tensors that only autocast-covered ops
                        use, cast once at their producer        [rewrite mode only]   (rewrites/covered_narrowing.py)
    5. graph rewrites   passes a caller adds (the engine contract)  [rewrite mode]    (GraphRewrite)
    6. verify           the final analysis: what remains is what enforce judges   [rewrite mode only]

``lint`` runs it on a copy of each captured graph in ``Mode.REPORT`` (steps 1-3: the findings of
every round, the graph it keeps is thrown away); the backend runs it on the graph it compiles in
``Mode.REWRITE``; ``eager_casts`` runs it in ``Mode.CASTS`` on a copy (every rewrite, no verify) and
maps the casts to module hooks. Every step reads the graph through one ``PassContext``; no step analyses a graph another
step did not hand it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import fx

from fx_precision.passes.analysis import GraphAnalysis
from fx_precision.passes.context import GraphRewrite, Mode, PassContext
from fx_precision.passes.fixed_point import drop_artefacts, fix_sources
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.repropagate import repropagate
from fx_precision.passes.rewrites.covered_narrowing import narrow_covered_stream
from fx_precision.passes.rules.findings import Finding


@dataclass
class PipelineResult:
    """``first``: the graph as traced (after gather emulation). ``findings``: round 0's findings
    followed by every masked one, each with its round. ``final``: what remains after every pass.
    ``casts``: every cast inserted or retargeted, in order. ``rounds``: rounds of source casts."""

    first: GraphAnalysis
    final: GraphAnalysis
    findings: list[Finding]
    casts: list[InsertedCast] = field(default_factory=list)
    rounds: int = 0
    rewrites: dict[str, Sequence[object]] = field(default_factory=dict)

    @property
    def sources(self) -> list[Finding]:
        return [f for f in self.findings if f.is_source]

    @property
    def masked(self) -> list[Finding]:
        return [f for f in self.findings if f.masked]

    def report_analysis(self) -> GraphAnalysis:
        """The analysis a report shows: the graph as traced, with every round's findings."""
        first = self.first
        return GraphAnalysis(first.index, first.annotation, self.findings, first.census, first.gather_casts, first.retargeted, self.rounds)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, mode: Mode, rewrites: Sequence[GraphRewrite] = ()) -> PipelineResult:
    """Run the passes in order on ``gm`` (see the module docstring)."""
    first = ctx.analyse(gm, first=True)  # 1
    fixed = fix_sources(gm, first, ctx)  # 2
    result = PipelineResult(first, fixed.final, fixed.findings, fixed.casts, fixed.rounds)
    if ctx.compute is None:
        return result
    drop_artefacts(gm, result, ctx.compute)  # 3
    if mode is Mode.REPORT:
        return result
    narrowed = narrow_covered_stream(result.final.annotation, ctx.compute)  # 4
    result.casts += narrowed
    if narrowed and (mode is Mode.REWRITE or rewrites):  # the graph is read again: its dtypes must be current
        repropagate(gm, ctx.compute, ctx.device_type)  # consumers cast to compute anyway: nothing follows these dtypes
    for rewrite in rewrites:  # 5
        done = rewrite.apply(gm, ctx)
        result.rewrites[rewrite.name] = done
        if done:
            repropagate(gm, ctx.compute, ctx.device_type)
    if mode is Mode.REWRITE and (narrowed or any(result.rewrites.values())):
        result.final = ctx.analyse(gm)  # 6
    return result
