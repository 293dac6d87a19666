"""The backend's casts as module hooks: the precision fix for forwards that run (partly) eagerly.

    eager_casts(model, ids, policy=policy, plan=plan)      (meta and fake models work, as for lint)
    ├── capture the Dynamo graph(s)                           (as lint does)
    ├── run_pipeline(copy, CASTS)                             (the casts the backend would insert)
    └── each cast, mapped to a module boundary:
        source-output     model.embed_tokens  out     fp32 -> bf16   forward hook   (FXP001 embedding)
                          model.layers.*.input_layernorm  out  ...   forward hook   (FXP002, masked by it)
        source-operand    transformer.wpe     out     fp32 -> bf16   forward hook   (only when the operand has that one use)
        covered-narrowing model.layers.*.ln_1 out     fp32 -> bf16   forward hook   (its consumers cast it anyway)
        gather-emulation  -                                          FSDP2 gathers at the unit dtype (apply_fsdp2)
        weight-read       -                                          the same: the experts' rule gathers them narrow
        dtype-following   -                                          eager code follows runtime dtypes: nothing to do
        a cast inside a module, not on its output                    compile-only, with the reason

    EagerFix
    ├── hooks          EagerHook(modules glob, output path, from, to, kind, the finding it fixes)
    ├── compile_only   (cast, reason)
    ├── gathers        gather rules no output hook can make: a weight an uncovered op reads (MoE experts,
    │                  grouped_mm) at the compute dtype
    ├── apply(model)   registers the hooks (first, so every later hook sees narrowed outputs); the globs also
    │                  match a smaller model of the same family. The gathers: on one device, the module's
    │                  parameters read at the rule's dtype in its forward (a cast of the master, as FSDP2
    │                  gathers); under FSDP2, checked against the unit's param_dtype (the policy's spec must
    │                  carry the rule before apply_fsdp2, as resolve_policy's does) and refused if it differs.
    │                  So the eager model computes what the backend does, with no step of the caller's
    └── remove()       the model is exactly as before

Hooks are plain forward hooks: they work on FSDP2-wrapped modules (FQNs do not change under
``fully_shard``), under activation checkpointing (a cast recomputes alike) and on tied embeddings
(the hook is on the embedding module, not on the shared parameter). Eager with the hooks and the
backend with ``aot_eager`` compute the same numbers: each hook is the cast the backend inserts, at
the same value.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils.hooks import RemovableHandle

from fx_precision.autocast import autocast_context
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError
from fx_precision.passes.analysis import copy_graph_module
from fx_precision.passes.capture import ModuleIO, capture_graphs, fake_forward_io
from fx_precision.passes.context import Mode
from fx_precision.passes.graph.casts import InsertedCast
from fx_precision.passes.graph.kinds import CastKind
from fx_precision.passes.graph.nodes import behind_views, module_path, node_value, op_name
from fx_precision.passes.pipeline import PipelineResult, run_pipeline
from fx_precision.plan import PrecisionPlan
from fx_precision.policy import PrecisionPolicy
from fx_precision.spec import ModuleSel, PrecisionSpec, Rule

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass(frozen=True)
class EagerHook:
    """Cast ``path`` of the output of every module matching ``modules`` from ``frm`` to ``to``."""

    modules: str  # an FQN, or a glob with ``*`` for a repeated index (model.layers.*.input_layernorm)
    path: str  # out, out[0], out.last_hidden_state
    frm: torch.dtype
    to: torch.dtype
    kind: CastKind  # why the backend casts there
    fixes: str  # the finding (code and node) or reason it answers
    exact: bool = True  # False: the module returns a value computed after the compiled cast's subject

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "frm": dtype_name(self.frm), "to": dtype_name(self.to)}


@dataclass
class EagerFix:
    """The hooks derived from one analysis; ``apply`` registers them, ``remove`` takes them off."""

    hooks: list[EagerHook] = field(default_factory=list)
    compile_only: list[tuple[InsertedCast, str]] = field(default_factory=list)
    gathers: PrecisionSpec = field(default_factory=PrecisionSpec)  # units to gather at compute (weight reads: MoE experts)
    reads: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per gathered module, the parameters the uncovered op reads
    _handles: list[RemovableHandle | _ReadAt] = field(default_factory=list, repr=False)

    def apply(self, model: nn.Module) -> EagerFix:
        """Register every hook on ``model`` (another instance of the family works: globs are matched
        here) and make the gathers (module docstring). Raises, registering nothing, when a hook or a gather
        matches no module, or an FSDP2 unit gathers a module at another dtype than its rule."""
        if self._handles:
            raise PrecisionError("this EagerFix is applied already; remove() it first, or derive another for a second model")
        names = [fqn for fqn, _ in model.named_modules()]
        plan: list[tuple[nn.Module, list[EagerHook]]] = []
        by_module: dict[str, list[EagerHook]] = {}
        for hook in self.hooks:
            pattern = _glob(hook.modules)
            hits = [n for n in names if pattern.fullmatch(n)]
            if not hits:
                raise PrecisionError(
                    f"eager fix: hook for {hook.modules!r} ({hook.fixes}) matches no module of {type(model).__name__}; "
                    "derive the fix for this model (fxp.eager_casts)"
                )
            for name in hits:
                by_module.setdefault(name, []).append(hook)
        for name, hooks in by_module.items():
            plan.append((model.get_submodule(name), hooks))
        gathered = [(fqn, module, dtype) for fqn, module, dtype in _gather_targets(model, self.gathers) if module is not None]
        for module, hooks in plan:
            self._handles.append(module.register_forward_hook(_caster(hooks), prepend=True))
        for fqn, module, dtype in gathered:
            self._handles.append(_ReadAt(module, dtype, self.reads.get(fqn)))
        return self

    def gathered_policy(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """``policy`` with the fix's gathers added to its spec (those it does not hold already): the policy to plan and
        ``apply_fsdp2`` with when the fix was derived before the wrap, so FSDP2 gathers the experts as the backend reads them."""
        from dataclasses import replace

        missing = tuple(rule for rule in self.gathers.rules if rule not in policy.spec.rules)
        return replace(policy, spec=PrecisionSpec(policy.spec.rules + missing)) if missing else policy

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> EagerFix:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def render(self) -> str:
        from tabulate import tabulate

        rows = [[h.modules, h.path, f"{dtype_name(h.frm)} -> {dtype_name(h.to)}", h.kind, h.exact, h.fixes] for h in self.hooks]
        headers = ["module(s)", "output", "dtypes", "cast", "exact", "fixes"]
        text = tabulate(rows, headers=headers) if rows else "no hooks: nothing to fix"
        if self.gathers:
            text += (
                f"\n\ngathers (apply reads these modules' weights at the dtype on one device; under FSDP2 the policy's spec "
                f"must carry them before apply_fsdp2): {self.gathers.text()}"
            )
        if self.compile_only:
            text += "\n\ncompile-only (no module boundary to hook):\n" + "\n".join(
                f"  {c.node} ({c.kind}) in {c.module or '<root>'}: {why}" for c, why in self.compile_only
            )
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "hooks": [h.to_dict() for h in self.hooks],
            "compile_only": [{**c.to_dict(), "why": why} for c, why in self.compile_only],
            "gathers": [rule.text() for rule in self.gathers.rules],
        }


def _gather_targets(model: nn.Module, gathers: PrecisionSpec) -> list[tuple[str, nn.Module | None, torch.dtype]]:
    """Each gather rule's FQN, module and dtype; no module where an FSDP2 unit already gathers it so. Raises where a rule's
    module is missing, or an FSDP2 unit gathers it at another dtype (the hooks cannot re-gather a sharded weight)."""
    from fx_precision.fsdp import fsdp_units

    units = dict(fsdp_units(model))
    out: list[tuple[str, nn.Module | None, torch.dtype]] = []
    for rule in gathers.rules:
        fqn, dtype = rule.select.fqn or "", rule.gather
        if not isinstance(dtype, torch.dtype):  # eager_casts makes rules of a dtype; a hand-made spec may hold others
            raise PrecisionError(f"eager fix: gather rule {rule.text()!r} names no dtype to gather at; give it one (gather:bf16)")
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise PrecisionError(
                f"eager fix: gather rule {rule.text()!r} selects no module of {type(model).__name__}; derive the fix for this "
                "model (fxp.eager_casts)"
            ) from None
        owner = max((u for u in units if u == "" or fqn == u or fqn.startswith(u + ".")), key=len, default=None)
        if owner is None:
            out.append((fqn, module, dtype))
            continue
        param_dtype = units[owner].param_dtype
        if param_dtype != dtype:
            raise PrecisionError(
                f"eager fix: {fqn} must be gathered at {dtype_name(dtype)} (an op autocast does not cover reads its weights), "
                f"but its FSDP2 unit {owner or '<root>'} gathers at {dtype_name(param_dtype) if param_dtype else 'the master dtype'}: "
                f"add the rule {rule.text()!r} to the policy's spec before apply_fsdp2 (resolve_policy's experts rule does)"
            )
        out.append((fqn, None, dtype))
    return out


class _ReadAt:
    """``module``'s floating parameters (``names``: those the backend casts; default all) read at ``dtype`` in each of
    its forwards (a differentiable cast of the master: the gradient reaches the master as FSDP2's gather gives it), as
    ``fsdp.gathered_eagerly`` does for a whole model;
    the parameters are themselves again when the forward returns or raises. One wrapper of the module's forward (not a
    pre-hook and a hook: Dynamo traces one ``with`` block whole, and breaks the graph on a context entered in one hook
    and left in another); ``remove()`` puts the forward back."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, names: tuple[str, ...] | None = None) -> None:
        from torch.nn.utils.stateless import _reparametrize_module

        self.module = module
        self.own = module.__dict__.get("forward")  # an instance forward set before (another wrapper), kept under this one
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            cast = {n: p.to(dtype) for n, p in module.named_parameters()
                    if p.is_floating_point() and p.dtype != dtype and (names is None or n in names)}  # fmt: skip
            with _reparametrize_module(module, cast):
                return original(*args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        if self.own is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.own


def _glob(text: str) -> re.Pattern[str]:
    return re.compile(re.escape(text).replace(r"\*", r"\d+"))


def _caster(hooks: list[EagerHook]) -> Any:
    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        for spec in hooks:
            output = _cast_at(output, spec.path, "out", spec.frm, spec.to)
        return output

    return hook


def _cast_at(value: Any, path: str, here: str, frm: torch.dtype, to: torch.dtype) -> Any:
    """``value`` with the tensor at ``path`` cast (when it has dtype ``frm``); containers rebuilt, not mutated."""
    if isinstance(value, torch.Tensor):
        return value.to(to) if here == path and value.dtype == frm else value
    if not path.startswith(here):
        return value
    if isinstance(value, dict):  # transformers' ModelOutput too: set the item on a shallow copy
        out = value.__class__(**value) if hasattr(value, "to_tuple") else dict(value)
        for key, item in value.items():
            out[key] = _cast_at(item, path, f"{here}.{key}", frm, to)
        return out
    if isinstance(value, (tuple, list)):
        items = [_cast_at(item, path, f"{here}[{i}]", frm, to) for i, item in enumerate(value)]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    return value


def eager_casts(
    model: nn.Module,
    *args: Any,
    policy: PrecisionPolicy | None = None,
    plan: PrecisionPlan | None = None,
    device_type: str | None = None,
    **kwargs: Any,
) -> EagerFix:
    """Derive the eager fix of ``model(*args, **kwargs)`` (see the module docstring); registers nothing."""
    from fx_precision.lint import graph_setup

    setup = graph_setup(model, policy, plan, device_type)
    if setup.compute is None:
        return EagerFix()  # no autocast: nothing is narrower than anything
    autocast = autocast_context(setup.compute, setup.device_type)
    captured, names = capture_graphs(model, args, kwargs, dynamic=False, device_type=setup.device_type, autocast=autocast)
    runs = []
    for i, cap in enumerate(captured):
        gm = copy_graph_module(cap.gm)
        ctx = setup.context(cap.example_inputs, i, names=names, emulate=plan is not None)
        runs.append((gm, run_pipeline(gm, ctx, Mode.CASTS)))
    hooked = (CastKind.SOURCE_OUTPUT, CastKind.SOURCE_OPERAND, CastKind.COVERED)
    subjects = {c.of for _, r in runs for c in r.casts if c.kind in hooked}
    hosts = {module_path(n) for gm, _ in runs for n in gm.graph.nodes if n.name in subjects} - {""}
    # a fresh autocast context: a context manager is entered once
    outputs = fake_forward_io(
        model, args, kwargs, device_type=setup.device_type, autocast=autocast_context(setup.compute, setup.device_type), modules=hosts
    )
    fix = EagerFix()
    reads: dict[str, list[str]] = {}
    for gm, result in runs:
        nodes = {n.name: n for n in gm.graph.nodes}
        for cast in result.casts:
            hook, why = _to_hook(cast, nodes, result, outputs)
            if hook is not None:
                fix.hooks.append(hook)
            elif why:
                fix.compile_only.append((cast, why))
            param = _weight_read(cast, nodes, result) if cast.kind is CastKind.WEIGHT_READ else None
            if param is not None:
                owner, _, name = param.rpartition(".")
                if name not in reads.setdefault(owner, []):
                    reads[owner].append(name)
    fix.hooks = _collapse(fix.hooks, [fqn for fqn, _ in model.named_modules()])
    fix.gathers = PrecisionSpec(tuple(Rule(ModuleSel(fqn=fqn), gather=setup.compute) for fqn in reads))
    fix.reads = {fqn: tuple(names) for fqn, names in reads.items()}
    return fix


def _weight_read(cast: InsertedCast, nodes: dict[str, fx.Node], result: PipelineResult) -> str | None:
    """The parameter (FQN) a weight-read cast reads (through views)."""
    operand = nodes.get(cast.of)
    info = result.first.annotation.info.get(behind_views(operand)) if operand is not None else None
    return info.param if info is not None and info.param else None


def apply_eager_fix(
    policy: PrecisionPolicy, model: nn.Module, *example_args: Any, plan: PrecisionPlan | None = None, **example_kwargs: Any
) -> EagerFix:
    """Derive the backend's casts for ``model`` under ``policy`` (``eager_casts``) and register them as forward
    hooks; returns the handle (``.remove()`` takes them off). Derive on the plain model (meta works) before
    ``apply_fsdp2``, or after: FQNs do not change under ``fully_shard``."""
    from fx_precision.lowering import compile_precision

    if plan is None:
        plan = compile_precision(model, policy.spec, default_gather=policy.gather, default_master=policy.master)
    return eager_casts(model, *example_args, policy=policy, plan=plan, **example_kwargs).apply(model)


def _finding_text(cast: InsertedCast, findings: list[Any]) -> str:
    finding = next((f for f in findings if f.node == cast.fixes), None)
    if finding is None:
        return cast.reason.split(":")[0]
    masked = f", masked by {', '.join(finding.masked_by)}" if finding.masked else ""
    return f"{finding.code} {finding.kind} at {finding.module or '<root>'}{masked}"


def _to_hook(cast: InsertedCast, nodes: dict[str, fx.Node], result: PipelineResult, outputs: ModuleIO) -> tuple[EagerHook | None, str]:
    """The module output hook that makes ``cast`` eagerly, or why there is none ("" when none is needed).

    Exact when the cast's subject is what its module returns. When the module computes more after
    it (Gemma's scaled embedding: ``embedding(ids) * scale`` inside ``embed_tokens``), the hook casts
    what the module returns instead: the stream is as narrow, the numbers one rounding apart, and
    the hook says so (``exact=False``)."""
    if cast.kind is CastKind.GATHER:
        return None, "a gather: apply_fsdp2 gathers each unit at its planned dtype (eagerly on one device: gathered_eagerly)"
    if cast.kind is CastKind.WEIGHT_READ:
        return None, (
            "a weight read by an op autocast does not cover (grouped_mm): one of the fix's gathers (apply reads the module's "
            "weights at the compute dtype; under FSDP2 resolve_policy's stacked-experts rule gathers its unit so)"
        )
    if cast.kind is CastKind.RETARGET:
        return None, ""  # eager code follows the runtime dtype: once the source is narrow, so is this
    subject = nodes.get(cast.of)
    if subject is None:
        return None, f"the cast's subject {cast.of} is not in the graph"
    module = module_path(subject)
    if not module:
        return None, f"{cast.of} is computed in the root module, not returned by a submodule: no module boundary to hook"
    inserted = nodes.get(cast.node)
    uses = [u for u in subject.users if u is not inserted] + (list(inserted.users) if inserted is not None else [])
    exits = [subject] if any(u.op == "output" or not _inside(module_path(u), module) for u in uses) else []
    exact = bool(exits)
    if not exits:  # what the module returns, computed from the subject
        first = result.first.annotation
        origin = cast.fixes or cast.of
        exits = [
            info.node
            for info in first.info.values()
            if info.wide
            and _inside(info.module, module)
            and origin in info.origin
            and any(u.op == "output" or not _inside(module_path(u), module) for u in info.consumers)
        ]
        if len(exits) != 1:
            return None, f"{cast.of} is computed inside {module} and no one value it returns carries it: no module boundary to hook"
    if cast.kind is CastKind.SOURCE_OPERAND and len([u for u in subject.users if u is not inserted]) > 1:
        return None, f"{cast.of} leaves {module} for other uses too, which keep it wide: only the compiled cast is exact"
    value = node_value(exits[0])
    traced = result.first.annotation.info[exits[0]].dtype  # as traced: the eager forward as-is returns that
    if not isinstance(value, torch.Tensor) or traced is None:
        return None, f"{exits[0].name} is not a tensor"
    paths = [p for p, shape, dtype in outputs.get(module, []) if dtype == traced and shape == tuple(value.shape)]
    if len(paths) != 1:
        why = "none" if not paths else f"{len(paths)} ({', '.join(paths)})"
        return None, f"{exits[0].name} is not one output of {module}: {why} of its outputs has its dtype and shape"
    fixes = _finding_text(cast, result.findings)
    if not exact:
        fixes += f" (cast after {op_name(exits[0])}, which {module} computes from it: one rounding later than the compiled cast)"
    return EagerHook(module, paths[0], traced, cast.to, cast.kind, fixes, exact), ""


def _inside(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


def _collapse(hooks: list[EagerHook], names: list[str]) -> list[EagerHook]:
    """One glob per repeated hook: ``model.layers.0.norm`` ... ``model.layers.N.norm`` -> ``model.layers.*.norm``
    when every module the glob matches carries the same cast, so the fix applies to a model of the
    family at any depth (a hook on every other layer of a hybrid stays per layer)."""
    groups: dict[tuple[str, str, torch.dtype, torch.dtype, str, bool], list[EagerHook]] = {}
    for hook in hooks:
        key = (_INDEX.sub("*", hook.modules), hook.path, hook.frm, hook.to, hook.kind, hook.exact)
        groups.setdefault(key, []).append(hook)
    out = []
    for (glob, path, frm, to, kind, exact), members in groups.items():
        everywhere = {m.modules for m in members} == {n for n in names if _glob(glob).fullmatch(n)}
        if len(members) > 1 and glob != members[0].modules and everywhere:
            fixes = members[0].fixes if len({m.fixes.split(" at ")[0] for m in members}) == 1 else "several findings"
            out.append(EagerHook(glob, path, frm, to, CastKind(kind), _INDEX.sub("*", fixes), exact))
        else:
            out.extend(members)
    return out


@contextlib.contextmanager
def eager_fixed(model: nn.Module, fix: EagerFix) -> Iterator[EagerFix]:
    """``with eager_fixed(model, fix): ...``: the hooks for the duration of the block."""
    fix.apply(model)
    try:
        yield fix
    finally:
        fix.remove()
