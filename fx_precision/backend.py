"""``precision_backend``: enforce the precision contract inside ``torch.compile``, then hand the graph on.

    torch.compile(model, backend=precision_backend)
      Dynamo graph ─▶ analyse_graph (annotate, emulate gathers)          <- the analysis lint uses
                   ─▶ cast each source's output to compute dtype         (source_casts.py)
                   ─▶ re-propagate, analyse again, verify                (enforce: raise on errors)
                   ─▶ inner compiler: "inductor" | "aot_eager" | any backend callable

Modes: ``enforce`` (fix, verify, raise ``PrecisionError`` if an error-severity finding remains;
``strict=True`` also raises on warnings), ``lint`` (report only, graph unchanged), ``off``.
Every compiled graph leaves a ``GraphReport`` in ``backend.reports``; ``TORCH_LOGS=fx_precision``
(or ``FX_PRECISION_LOG=1``) logs each one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fx_precision.autocast import ambient_compute
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.module_graph import module_label
from fx_precision.passes.analysis import copy_graph_module
from fx_precision.passes.capture import tensor_names
from fx_precision.passes.context import GraphRewrite, GraphSetup, Mode, PassContext
from fx_precision.passes.graph.annotate import param_names
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind, ParamKind, severity_rank
from fx_precision.passes.graph.nodes import module_path
from fx_precision.passes.graph.units import UnitIndex
from fx_precision.passes.pipeline import run_pipeline
from fx_precision.passes.repropagate import graph_device_type
from fx_precision.passes.rules.findings import Finding
from fx_precision.plan import PrecisionPlan
from fx_precision.policy import PrecisionPolicy

log = logging.getLogger("fx_precision.backend")
MODES = ("enforce", "lint", "off")


# TORCH_LOGS=fx_precision is handled by torch._logging itself (it accepts Python module names and
# configures that logger); FX_PRECISION_LOG=1 is the opt-in for runs that do not use TORCH_LOGS.
if os.environ.get("FX_PRECISION_LOG", "") not in ("", "0") and not log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[fx_precision] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)


@dataclass
class GraphReport:
    """What the pass saw and did to one compiled graph."""

    index: int
    mode: str
    compute: torch.dtype | None
    before: list[Finding] = field(default_factory=list)
    after: list[Finding] = field(default_factory=list)
    casts: list[InsertedCast] = field(default_factory=list)
    pass_seconds: float = 0.0
    inner_seconds: float = 0.0
    stream_before: dict[str, int] = field(default_factory=dict)
    stream_after: dict[str, int] = field(default_factory=dict)
    note: str = ""
    rounds: int = 0
    rewrites: dict[str, int] = field(default_factory=dict)  # graph rewrites after the fix (a contract's), changes each

    def casts_of(self, *kinds: CastKind) -> list[InsertedCast]:
        return [c for c in self.casts if c.kind in kinds]

    @property
    def gather_casts(self) -> list[InsertedCast]:
        return self.casts_of(CastKind.GATHER)

    @property
    def source_casts(self) -> list[InsertedCast]:
        return self.casts_of(CastKind.SOURCE_OUTPUT, CastKind.SOURCE_OPERAND)

    @property
    def retargeted(self) -> list[InsertedCast]:
        return self.casts_of(CastKind.RETARGET)

    def summary(self) -> str:
        lines = [
            f"graph {self.index} ({self.mode}, compute {dtype_name(self.compute) if self.compute else 'none'}): "
            f"{len(self.before)} finding(s) before, {len(self.after)} after; {len(self.casts)} cast(s) inserted in {self.rounds} round(s); "
            f"stream {self.stream_before} -> {self.stream_after}; "
            f"pass {self.pass_seconds * 1e3:.1f} ms, inner compile {self.inner_seconds:.2f} s" + (f"; {self.note}" if self.note else "")
        ]
        lines.extend(
            f"  + {c.node}: {c.of} {dtype_name(c.frm)} -> {dtype_name(c.to)} in {module_label(c.module)} ({c.reason})" for c in self.casts
        )
        lines.extend(f"  ! {f.code} {f.kind} [{f.severity}] at {module_label(f.module)}: {f.message}" for f in self.after)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "mode": self.mode,
            "compute": dtype_name(self.compute) if self.compute else None,
            "before": [f.to_dict() for f in self.before],
            "after": [f.to_dict() for f in self.after],
            "casts": [c.to_dict() for c in self.casts],
            "pass_seconds": self.pass_seconds,
            "inner_seconds": self.inner_seconds,
            "stream_before": self.stream_before,
            "stream_after": self.stream_after,
            "note": self.note,
            "rounds": self.rounds,
            "rewrites": self.rewrites,
        }


def _inner_compiler(inner: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(inner):
        return inner
    from torch._dynamo import list_backends, lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        return lookup_backend(inner)
    except InvalidBackend:
        raise PrecisionError(
            f"inner={inner!r} is not a Dynamo backend; known: {', '.join(sorted(list_backends(exclude_tags=())))}, or pass a callable"
        ) from None


class PrecisionBackend:
    """A Dynamo backend ``(gm, example_inputs) -> callable`` enforcing a precision policy/plan."""

    def __init__(
        self,
        policy: PrecisionPolicy | None = None,
        plan: PrecisionPlan | None = None,
        inner: str | Callable[..., Any] = "inductor",
        mode: str = "enforce",
        strict: bool = False,
        model: nn.Module | None = None,
    ) -> None:
        if mode not in MODES:
            raise PrecisionError(f"make_precision_backend(mode={mode!r}): use one of {', '.join(MODES)}")
        self.policy = policy
        self.plan = plan
        self.inner = inner
        self.mode = mode
        self.strict = strict
        self.model = model  # names parameters by identity where the graph's names cannot (a module a resumed frame holds)
        if not callable(inner) and not isinstance(inner, str):
            raise PrecisionError(
                f"make_precision_backend(inner={inner!r}): pass a Dynamo backend name ('inductor', 'aot_eager') or a callable"
            )
        _inner_compiler(inner)  # an unknown name fails here, before any graph is compiled
        self.units = UnitIndex.from_plan(plan) if plan is not None else UnitIndex.from_units({"": None})
        self.reports: list[GraphReport] = []
        self._hop_breaks = _hop_graph_breaks()  # the ones before this backend compiled anything

    def _compute(self, device_type: str) -> tuple[torch.dtype | None, str]:
        """The compute dtype the graph was traced under (the ambient autocast), and a note when the
        policy names another: the pass never enforces a compute dtype that did not run."""
        ambient = ambient_compute([device_type])[0]
        wanted = self.policy.compute if self.policy is not None else None
        if wanted is None or ambient == wanted:
            return ambient, ""
        if ambient is None:
            return None, (
                f"the policy's compute is {dtype_name(wanted)} but this graph was traced without autocast: nothing enforced "
                "(run the compiled model under policy.forward_context())"
            )
        return ambient, f"the policy's compute is {dtype_name(wanted)} but the graph was traced under {dtype_name(ambient)} autocast"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        start = time.perf_counter()
        device_type = graph_device_type(gm)
        compute, note = self._compute(device_type)
        if self.policy is not None and self.policy.contract is not None and self.mode != "off" and compute != self.policy.compute:
            raise PrecisionError(
                f"precision_backend: the engine contract computes at bf16 and this graph was traced "
                f"{'without autocast' if compute is None else 'under ' + dtype_name(compute) + ' autocast'}: nothing of the contract "
                "would run. Call the compiled model under policy.forward_context()"
            )
        report = GraphReport(len(self.reports), self.mode, compute, note=note)
        self.reports.append(report)
        names = self._names()
        if self.plan is not None:
            self._check_plan_covers(gm, example_inputs, names)
        if self.mode == "off" or (compute is None and self.plan is None):
            report.note = "; ".join(
                filter(None, [report.note, "pass off" if self.mode == "off" else "no autocast and no plan: nothing to enforce"])
            )
        elif self.mode == "lint":
            ctx = self._context(example_inputs, compute, report.index, device_type, names)
            analysis = run_pipeline(copy_graph_module(gm), ctx, Mode.REPORT).report_analysis()
            report.before = report.after = analysis.findings
            report.stream_before = report.stream_after = analysis.census.stream
        else:
            _refuse_nested_graphs(gm, contract=self.policy is not None and self.policy.contract is not None)
            _refuse_untraced_hop_bodies(self._hop_breaks)
            self._enforce(gm, self._context(example_inputs, compute, report.index, device_type, names), report)
        report.pass_seconds = time.perf_counter() - start
        inner_start = time.perf_counter()
        with self._inner_config():
            compiled = _inner_compiler(self.inner)(gm, example_inputs)
        report.inner_seconds = time.perf_counter() - inner_start
        if log.isEnabledFor(logging.INFO):
            log.info(report.summary())
        return compiled

    def _names(self) -> dict[int, tuple[str, ParamKind]] | None:
        """id -> (FQN, kind) of the model's parameters and buffers as they are now: inside the forward, so under FSDP2
        the unsharded ones the graph reads. Dynamo names a parameter after the source it read it from, and a module a
        resumed frame holds on its stack (``self.head(self.body(x))`` with a graph break in ``body``) has no FQN there."""
        return tensor_names(self.model) if self.model is not None else None

    def _check_plan_covers(self, gm: fx.GraphModule, example_inputs: list[Any], names: dict[int, tuple[str, ParamKind]] | None) -> None:
        """Every parameter this graph reads is in the plan: a plan of another model would emulate
        gathers, and attribute units, that belong to nothing here."""
        for fqn, kind in param_names(gm, example_inputs, names).values():
            if kind is ParamKind.PARAMETER and self.units.param(fqn) is None:
                raise PrecisionError(
                    f"precision_backend: the graph reads parameter {fqn!r}, which the backend's plan does not hold; the plan "
                    "belongs to another model. Compile the plan for this model (compile_precision / policy.plan)"
                )

    def _context(self, example_inputs: list[Any], compute: torch.dtype | None, index: int, device_type: str,
                 names: dict[int, tuple[str, ParamKind]] | None) -> PassContext:  # fmt: skip
        setup = GraphSetup(compute, device_type, self.units)
        return setup.context(example_inputs, index, names=names, emulate=self.plan is not None)

    def _inner_config(self) -> contextlib.AbstractContextManager[Any]:
        """Under an engine contract Inductor keeps every cast the graph holds (emulate_precision_casts):
        fp32 math fused across a bf16 round trip would not be what the engine computes."""
        if self.policy is None or self.policy.contract is None or self.inner != "inductor":
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config

        if self.policy.contract.inductor is not None:  # the compiled engine: Inductor's own settings, as the engine ran them
            from fx_precision.contract.inductor_build import following_simdlen

            simdlen = following_simdlen(self.policy.contract.inductor)  # its vector ISA, where this CPU picks a wider one
            return inductor_config.patch({"cpp.simdlen": simdlen}) if simdlen is not None else contextlib.nullcontext()

        return inductor_config.patch(emulate_precision_casts=True)

    def rewrites(self) -> list[GraphRewrite]:
        """Graph rewrites after the precision fix (pipeline step 5): the policy's engine contract's."""
        contract = self.policy.contract if self.policy is not None else None
        if contract is None:
            return []
        from fx_precision.passes.rewrites.engine import engine_rewrites

        if contract.inductor is not None:
            check_compiled_engine(
                contract.inductor,
                self.inner if isinstance(self.inner, str) else getattr(self.inner, "__name__", "?"),
                norm_orders=contract.norm_reductions is not None,
            )
        return engine_rewrites(contract)

    def _enforce(self, gm: fx.GraphModule, ctx: PassContext, report: GraphReport) -> None:
        result = run_pipeline(gm, ctx, Mode.REWRITE, self.rewrites())
        report.before = result.findings
        report.stream_before = result.first.census.stream
        report.casts = result.casts
        report.rounds = result.rounds
        report.after = result.final.findings
        report.stream_after = result.final.census.stream
        report.rewrites = {name: len(done) for name, done in result.rewrites.items()}
        threshold = "warn" if self.strict else "error"
        failing = [f for f in result.final.findings if severity_rank(f.severity) >= severity_rank(threshold)]
        if failing:
            details = "\n".join(f.explain() for f in failing)
            raise PrecisionError(
                f"precision_backend (enforce{', strict' if self.strict else ''}): {len(failing)} finding(s) remain after the pass "
                f"({result.rounds} round(s) of casts) in graph {report.index}:\n{details}"
            )


COMPILED_ENGINE_UNITS = (
    "the compiled engine's norms sum in the vector width Inductor picks for each fused kernel of its one whole-model graph "
    "(16 or 32 lanes, from what the kernel loads and stores); FSDP2 units break the training graph between decoder layers, "
    "where Inductor fuses and picks otherwise, so the contract follows it there only with the engine's own orders, read off "
    "its generated code by the rollout (contract.norm_reductions), and this contract has none"
)


def check_compiled_engine(engine_inductor: str, inner: str, world_size: int = 0, *, norm_orders: bool = False) -> None:
    """The compiled engine is followed by giving this process's Inductor the engine's graph (at the engine's vector ISA:
    ``following_simdlen``): refused where the training side does not compile with Inductor, or with another Inductor build
    than the engine's that no vector width of this CPU turns into it (contract/inductor_build.py),
    or runs FSDP2 units without the engine's norm orders (``norm_orders``: the contract holds them)."""
    from fx_precision.contract.inductor_build import following_simdlen, inductor_build, same_build

    if inner != "inductor":
        raise PrecisionError(
            f"engine contract: the engine compiled its model with Inductor ({engine_inductor}); the training side computes the same "
            f"only compiled by Inductor too, and runs {inner!r}: compare with --compiled (onpolicy compiles always), or roll out "
            "with --launch eager"
        )
    if world_size > 0 and not norm_orders:
        raise PrecisionError(
            f"engine contract: {COMPILED_ENGINE_UNITS}: roll out again with this version (it reads them), compare in one process "
            "(without --world-size), or roll out with --launch eager"
        )
    here = inductor_build(following_simdlen(engine_inductor))
    if not same_build(here, engine_inductor):
        raise PrecisionError(
            f"engine contract: the engine's Inductor was {engine_inductor!r} and this process's is {here!r}, and no vector width "
            "of this CPU picks the engine's: their kernels sum and round otherwise; run the training side with the engine's torch "
            "build on a CPU of the engine's family"
        )


def _refuse_nested_graphs(gm: fx.GraphModule, *, contract: bool) -> None:
    """A graph that holds a model's blocks inside a higher-order op is refused: activation checkpointing traces each
    checkpointed block into ``tag_activation_checkpoint``'s own graph, and the passes read and rewrite one graph, so
    the block would run unenforced without a word. Under an engine contract every nested graph is refused (each op
    must compute what the engine computes). Other higher-order ops of a plain policy (a custom ``autograd.Function``,
    Bloom's GELU: ``autograd_function_apply``) are ops of the outer graph, as their outputs' dtypes show."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        if not contract and "checkpoint" not in str(node.target):
            continue
        nested = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(getattr(gm, str(a.target), None),
                                                                                                        fx.GraphModule)]  # fmt: skip
        if nested:
            where = module_path(node) or "<root>"
            raise PrecisionError(
                f"precision_backend: {node.target} holds a nested graph at {where} (torch.utils.checkpoint and other "
                "higher-order ops trace their body into one), which the pass does not rewrite: its dtypes (and an engine "
                "contract) would not hold there. Compile the checkpointed blocks one by one (torch.compile each decoder layer, "
                "checkpoint around the compiled layer) or turn activation checkpointing off"
            )


def _hop_graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far inside a higher-order op's body (``torch.utils.checkpoint`` and the like), by count."""
    from torch._dynamo.utils import counters

    return {reason: count for reason, count in counters["graph_break"].items() if reason.startswith("HOP:")}


def _refuse_untraced_hop_bodies(before: dict[str, int]) -> None:
    """A checkpointed block (any higher-order op's body) Dynamo could not trace runs eagerly, outside every graph the
    pass sees, without a word: transformers >= 5.25 with the ``kernels`` package sets a context variable in an
    attention layer's forward, which Dynamo refuses inside ``torch.utils.checkpoint`` ("HOP: Unsafe side effect"), and
    the whole decoder layer runs eagerly. Refused as a nested graph is: its dtypes (and an engine contract) would not
    hold there. ``before``: the breaks counted when the backend was made (Dynamo's counters are per process)."""
    new = [reason for reason, count in _hop_graph_breaks().items() if count > before.get(reason, 0)]
    if new:
        first = " ".join(line.strip() for line in new[0].splitlines()[:3] if line.strip())
        raise PrecisionError(
            f"precision_backend: Dynamo could not trace a checkpointed block (a higher-order op's body: {first[:200]}) and "
            "runs it eagerly, outside the pass: its dtypes (and an engine contract) would not hold there. Compile the "
            "checkpointed blocks one by one (torch.compile each decoder layer, checkpoint around the compiled layer) or turn "
            "activation checkpointing off"
        )


def make_precision_backend(
    policy: PrecisionPolicy | None = None,
    plan: PrecisionPlan | None = None,
    inner: str | Callable[..., Any] = "inductor",
    mode: str = "enforce",
    strict: bool = False,
    model: nn.Module | None = None,
) -> PrecisionBackend:
    """A backend for ``torch.compile(model, backend=...)``; see the module docstring. ``model``: the model it compiles,
    to name the parameters a graph reads by identity (FSDP2 units whose frames resume with a module on the stack)."""
    return PrecisionBackend(policy=policy, plan=plan, inner=inner, mode=mode, strict=strict, model=model)


precision_backend = PrecisionBackend()
"""Ready-made: compute dtype from the autocast state captured with the graph, no plan, Inductor."""


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "fx_precision" in _COMPILER_FNS:
        return
    if _BACKENDS.get("fx_precision") is not None:
        return  # torch is loading us through the torch_dynamo_backends entry point and registers what it loads
    register_backend(name="fx_precision")(precision_backend)


_register()
