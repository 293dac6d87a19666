"""What every pass of one graph reads: the mode the pipeline runs in, the context, the rewrites a caller adds.

    Mode          REPORT (lint: a throw-away graph) | REWRITE (the graph compiled) | CASTS (eager_casts)
    GraphSetup    how a model's graphs are analysed (compute dtype, device type, units, FSDP2 re-cast)
                  └── context(...)  the one way a PassContext is made (lint, the backend, eager_casts)
    PassContext   compute dtype, device type, units, example inputs, names, graph index, emulation
                  └── analyse(gm)   the one analysis every step calls
    GraphRewrite  (name, apply(gm, ctx) -> [record])   pipeline step 5 (the engine contract's rewrites)

Its own module so the drivers (``fixed_point``, ``pipeline``) and the rewrites that take a context
import it without importing each other.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fx_precision.passes.analysis import GraphAnalysis, analyse_graph
from fx_precision.passes.graph.kinds import ParamKind
from fx_precision.passes.graph.units import UnitIndex


class Mode(enum.Enum):
    REPORT = "report"  # analyse and fix on a throw-away graph: findings of every round
    REWRITE = "rewrite"  # the graph is the one compiled: every rewrite applies, then verify
    CASTS = "casts"  # every rewrite on a throw-away graph, no verify: the casts are what is wanted (eager_casts)


@dataclass(frozen=True)
class GraphSetup:
    """How a model's graphs are analysed: the compute dtype, whose autocast lists, units, FSDP2 re-cast."""

    compute: torch.dtype | None
    device_type: str
    units: UnitIndex
    fsdp_cast: bool | None = None

    def context(
        self, example_inputs: list[Any] | None, index: int, *, names: dict[int, tuple[str, ParamKind]] | None = None, emulate: bool = False
    ) -> PassContext:
        """The context of graph ``index`` (its example inputs, the parameter names the capture found): every pass
        of that graph reads it. ``emulate``: a plan on one device, so gathers are cast at use."""
        return PassContext(self.compute, self.device_type, self.units, example_inputs, names, index, emulate, self.fsdp_cast)


@dataclass
class PassContext:
    """What every pass of one graph needs to know, fixed for the whole pipeline run.

    ``emulate``: cast parameters seen at master dtype to their unit's gather dtype (a plan on one
    device); only the first analysis does it, every later one sees the casts it inserted.
    """

    compute: torch.dtype | None
    device_type: str | None
    units: UnitIndex
    example_inputs: list[Any] | None = None
    known_names: dict[int, tuple[str, ParamKind]] | None = None
    index: int = 0
    emulate: bool = False
    fsdp_cast_inputs: bool | None = None

    def analyse(self, gm: fx.GraphModule, *, first: bool = False) -> GraphAnalysis:
        return analyse_graph(
            gm,
            self.example_inputs,
            compute=self.compute,
            units=self.units,
            known_names=self.known_names,
            emulate=self.emulate and first,
            index=self.index,
            fsdp_cast_inputs=self.fsdp_cast_inputs,
            device_type=self.device_type,
        )


@dataclass(frozen=True)
class GraphRewrite:
    """A rewrite a caller adds after the precision fix (step 5): ``apply(gm, ctx)`` edits ``gm`` in
    place and returns what it did, one record per change (an engine contract's: ``EngineRewrite``)."""

    name: str
    apply: Callable[[fx.GraphModule, PassContext], Sequence[object]]
