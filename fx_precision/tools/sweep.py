"""The compatibility sweep: every architecture of ``arch_zoo`` through lint, the backend and FSDP2.

    per architecture (fp32 weights, bf16 autocast on cpu)
    ├── lint as-is               findings by kind, masked ones, rounds to the fixed point
    ├── fp32 stream tensors      as traced | after precision_backend | after a hand fix
    │                            (counted by ``fp32_stream_nodes`` on the graph handed to the inner
    │                            compiler: it reads dtypes and module stacks, never the analysis)
    ├── enforce (aot_eager)      forward + backward: errors left, gradient dtypes, logits' relative
    │                            max error against the eager forward as-is and the eager hand fix
    ├── eager fix                the backend's casts as module hooks (fxp.eager_casts): fp32 stream
    │                            tensors as traced with the hooks on, and whether eager logits and
    │                            gradients are bitwise those of the backend with aot_eager (else the
    │                            hook that differs, and why)
    └── census (1 gloo rank)     module-IO dtypes under FSDP2 with resolve_policy's defaults, as-is
                                 and with the eager fix

The *hand fix* is what a careful user writes in eager code: cast the output of every input
embedding and of every norm module to the compute dtype. An architecture that cannot be built,
traced or compiled is listed with the reason, never dropped.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from fx_precision.logprobs import logits_of
from fx_precision.passes.graph.nodes import module_path
from fx_precision.tools.arch_zoo import ARCHS, Arch, arch
from fx_precision.training_side import compile_limits

COMPUTE = torch.bfloat16
Recorder = Callable[[str, str, fx.GraphModule], None]


def fp32_stream_nodes(gm: fx.GraphModule) -> list[str]:
    """fp32 activations that cross a module boundary or leave the graph (placeholders excluded)."""

    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if node.op in ("placeholder", "output", "get_attr") or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            continue
        if any(user.op == "output" or module_path(user) != module_path(node) for user in node.users):
            found.append(node.name)
    return found


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


@contextlib.contextmanager
def hand_fixed(model: nn.Module, compute: torch.dtype = COMPUTE) -> Iterator[None]:
    """Forward hooks casting every embedding's and every norm's float output to ``compute``."""
    handles = []

    def cast(_module: nn.Module, _args: Any, out: Any) -> Any:
        return out.to(compute) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    for module in model.modules():
        if isinstance(module, nn.Embedding) or _is_norm(module):
            handles.append(module.register_forward_hook(cast))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _recording(name: str, stage: str, record: Recorder | None, counts: dict[str, int], inner: str = "aot_eager") -> Callable[..., Any]:
    from torch._dynamo import lookup_backend

    compile_inner = lookup_backend(inner)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        counts[stage] = counts.get(stage, 0) + len(fp32_stream_nodes(gm))
        if record is not None:
            record(name, stage, gm)
        return compile_inner(gm, example_inputs)

    return backend


def _error(exc: BaseException) -> str:
    inner = getattr(exc, "inner_exception", None) or exc
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return f"{type(inner).__name__}: {first[:300]}"


def sweep_arch(spec: Arch, *, seq_len: int = 8, record: Recorder | None = None) -> dict[str, Any]:
    """One architecture's row (see the module docstring); ``record(arch, stage, gm)`` sees each graph."""
    import fx_precision as fxp
    from fx_precision.lint import lint

    row: dict[str, Any] = {"arch": spec.name, "model": spec.model, "patterns": list(spec.patterns), "batch": spec.batch}
    start = time.perf_counter()
    try:
        model = spec.build()
    except Exception as exc:  # a transformers version without this architecture, a config it rejects
        row["error"] = f"build: {_error(exc)}"
        return row
    built: Any = model  # a transformers PreTrainedModel
    row["tied"] = built.get_input_embeddings().weight is getattr(built.get_output_embeddings(), "weight", None)
    vocab = int(built.config.vocab_size)
    ids = torch.randint(0, vocab, (spec.batch, seq_len), generator=torch.Generator().manual_seed(1))
    autocast = torch.autocast("cpu", dtype=COMPUTE)
    counts: dict[str, int] = {}
    stage = "eager"
    try:
        with autocast:
            reference = logits_of(model(input_ids=ids)).detach().float()
            with hand_fixed(model):
                by_hand = logits_of(model(input_ids=ids)).detach().float()
        stage = "lint"
        with autocast:
            report = lint(model, input_ids=ids)
        row["lint"] = {
            "by_kind": dict(Counter(f.kind for f in report.findings)),
            "sources": sum(f.is_source for f in report.findings),
            "masked": sum(f.masked and f.is_source for f in report.findings),  # of the sources, those that were masked
            "rounds": max((g.rounds for g in report.graphs), default=0),
            "graphs": len(report.graphs),
        }
        stage = "as traced"
        for label, fix in (("as_traced", contextlib.nullcontext()), ("hand_fix", hand_fixed(model))):
            with fix, autocast, torch.no_grad():
                torch.compile(model, backend=_recording(spec.name, label, record, counts, inner="eager"), dynamic=False)(input_ids=ids)
        stage = "enforce"
        backend = fxp.make_precision_backend(inner=_recording(spec.name, "enforced", record, counts))
        model.zero_grad(set_to_none=True)
        with autocast:
            logits = logits_of(torch.compile(model, backend=backend, dynamic=False)(input_ids=ids))
        logits.float().pow(2).mean().backward()
        row["enforce"] = {
            "errors_after": sum(f.severity == "error" for r in backend.reports for f in r.after),
            "warnings_after": sum(f.severity == "warn" for r in backend.reports for f in r.after),
            "casts": sum(len(r.casts) for r in backend.reports),
            "rounds": max((r.rounds for r in backend.reports), default=0),
            "pass_seconds": sum(r.pass_seconds for r in backend.reports),
        }
        row["grad_dtypes"] = sorted({str(p.grad.dtype).removeprefix("torch.") for p in model.parameters() if p.grad is not None})
        compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        stage = "eager fix"
        row["eager_fix"] = _eager_fix_row(spec, model, ids, logits.detach(), compiled_grads, record, counts)
        got = logits.detach().float()
        row["logits_rel_max_error"] = float((got - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
        row["logits_rel_max_error_vs_hand_fix"] = float((got - by_hand).abs().max() / by_hand.abs().max().clamp_min(1e-12))
    except Exception as exc:
        row["error"] = f"{stage}: {_error(exc)}"
        row["traceback"] = traceback.format_exc(limit=-3)
    row["fp32_stream"] = {
        "as_traced": counts.get("as_traced"),
        "enforced": counts.get("enforced"),
        "hand_fix": counts.get("hand_fix"),
        "eager_fix": counts.get("eager_fix"),
    }
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _eager_fix_row(
    spec: Arch,
    model: nn.Module,
    ids: torch.Tensor,
    compiled_logits: torch.Tensor,
    compiled_grads: dict[str, torch.Tensor],
    record: Recorder | None,
    counts: dict[str, int],
) -> dict[str, Any]:
    """Derive the eager fix, count its fp32 stream as traced, and compare eager fwd+bwd with the backend's."""
    import fx_precision as fxp

    fix = fxp.eager_casts(model, input_ids=ids, policy=fxp.PrecisionPolicy(compute=COMPUTE))
    inexact = [h for h in fix.hooks if not h.exact]
    with fix.apply(model):  # its hooks and its gathers (MoE experts read by grouped_mm: a cast of the master per call)
        with torch.autocast("cpu", dtype=COMPUTE), torch.no_grad():
            torch.compile(model, backend=_recording(spec.name, "eager_fix", record, counts, inner="eager"), dynamic=False)(input_ids=ids)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=COMPUTE):
            logits = logits_of(model(input_ids=ids))
        logits.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    logits_equal = torch.equal(logits.detach(), compiled_logits)
    grads_equal = grads.keys() == compiled_grads.keys() and all(torch.equal(grads[n], compiled_grads[n]) for n in grads)
    row: dict[str, Any] = {
        "hooks": len(fix.hooks),
        "gathers": len(fix.gathers),
        "inexact_hooks": len(inexact),
        "compile_only": len(fix.compile_only),
        "logits_bitwise": logits_equal,
        "grads_bitwise": grads_equal,
    }
    differing = sorted(n for n in grads if n in compiled_grads and not torch.equal(grads[n], compiled_grads[n]))
    if inexact:
        row["difference"] = "; ".join(f"{h.modules}: {h.fixes}" for h in inexact)
    elif differing:
        # measured, not assumed: does aot_eager alone (no pass, no hooks) differ from eager on these gradients?
        alone = _aot_eager_differs(model, ids)
        row["difference"] = f"gradients of {', '.join(differing[:3])}{' and more' if len(differing) > 3 else ''} differ; " + (
            "aot_eager alone (no pass, no hooks) differs from eager on them too: the inner compiler's backward, not the fix"
            if set(differing) <= alone
            else f"aot_eager alone differs on {len(alone)} gradient(s), not all of these: a difference of the fix, please report"
        )
    return row


def _aot_eager_differs(model: nn.Module, ids: torch.Tensor) -> set[str]:
    """Parameters whose gradient differs between eager and plain ``aot_eager`` (no pass), as-is."""
    grads = []
    for compiled in (False, True):
        model.zero_grad(set_to_none=True)
        run = torch.compile(model, backend="aot_eager", dynamic=False) if compiled else model
        with torch.autocast("cpu", dtype=COMPUTE):
            logits = logits_of(run(input_ids=ids))
        logits.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return {n for n in grads[0] if not torch.equal(grads[0][n], grads[1].get(n, grads[0][n] + 1))}


def census_rows(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    """Inside a gloo rank: each architecture under FSDP2 with ``resolve_policy`` defaults, census."""
    from fx_precision.census import census
    from fx_precision.eager_fix import eager_casts
    from fx_precision.fsdp import apply_fsdp2, layer_wrap_globs
    from fx_precision.policy import resolve_policy
    from fx_precision.ranks import cpu_mesh

    out: dict[str, Any] = {}
    for name in names:
        spec = arch(name)
        try:
            out[name] = {}
            for fixed in (False, True):
                model = spec.build()
                policy = resolve_policy(model, master="fp32", gather="fp32", compute="bf16")
                plan = policy.plan(model, wrap=layer_wrap_globs(model))
                vocab = int(getattr(model.config, "vocab_size"))  # noqa: B009 (a transformers config)
                ids = torch.randint(0, vocab, (spec.batch, 8), generator=torch.Generator().manual_seed(1))
                fix = eager_casts(model, input_ids=ids, policy=policy, plan=plan) if fixed else None
                apply_fsdp2(model, plan, mesh=cpu_mesh(world_size), policy=policy)
                with fix.apply(model) if fix is not None else contextlib.nullcontext(), policy.forward_context("cpu"):
                    result = census(model, input_ids=ids)
                floats = result.float_totals()
                counts = {"fp32": floats.get("fp32", 0), "bf16": floats.get("bf16", 0), "rules": len(policy.spec)}
                out[name].update(counts if not fixed else {"eager_fix_fp32": counts["fp32"], "eager_fix_bf16": counts["bf16"]})
        except Exception as exc:
            out[name] = {"error": _error(exc)}
    return out


def run_sweep(names: list[str] | None = None, *, census: bool = True, record: Recorder | None = None) -> list[dict[str, Any]]:
    """Rows for ``names`` (default: every architecture of ``arch_zoo``), in zoo order."""
    specs = [arch(n) for n in names] if names else list(ARCHS)
    census_run: dict[str, Any] = {}
    if census:  # its gloo rank is a process of its own: it runs while this one sweeps
        from fx_precision.ranks import run_on_ranks

        def run_census() -> None:
            try:
                (census_run["rows"],) = run_on_ranks(census_rows, 1, [s.name for s in specs])
            except BaseException as exc:  # re-raised below, in the caller's thread
                census_run["error"] = exc

        waiting = threading.Thread(target=run_census, name="sweep-census", daemon=True)
        waiting.start()
    with compile_limits(64):  # each architecture compiled by several backends: fresh graphs by each (no Dynamo reset)
        rows = [sweep_arch(spec, record=record) for spec in specs]
    if census:
        waiting.join()
        if "error" in census_run:
            raise census_run["error"]
        for row in rows:
            row["census"] = census_run["rows"][row["arch"]]
    return rows


def _eager_fix_cell(row: dict[str, Any]) -> str:
    fix = row.get("eager_fix")
    if not fix:
        return "-"
    census = row.get("census", {})
    bitwise = "yes" if fix["logits_bitwise"] and fix["grads_bitwise"] else "no*"
    return f"{row['fp32_stream'].get('eager_fix', '-')} / {census.get('eager_fix_fp32', '-')} / {bitwise}"


def render(rows: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    table = []
    for r in rows:
        lint = r.get("lint", {})
        enforce = r.get("enforce", {})
        stream = r.get("fp32_stream", {})
        census = r.get("census", {})
        table.append(
            [
                r["arch"],
                ", ".join(p for p in r["patterns"] if p != "tied") + (" (tied)" if r.get("tied") else ""),
                f"{lint.get('sources', '-')} ({lint.get('masked', '-')} masked)" if lint else "-",
                enforce.get("errors_after", "-"),
                f"{stream.get('as_traced', '-')} -> {stream.get('enforced', '-')} (hand {stream.get('hand_fix', '-')})",
                f"{r['logits_rel_max_error']:.1e} / {r['logits_rel_max_error_vs_hand_fix']:.1e}" if "logits_rel_max_error" in r else "-",
                ",".join(r.get("grad_dtypes", [])) or "-",
                census.get("error") or (f"{census['fp32']}/{census['fp32'] + census['bf16']}" if census else "-"),
                _eager_fix_cell(r),
                r.get("error", "ok"),
            ]
        )
    headers = [
        "architecture",
        "patterns",
        "lint sources",
        "errors after",
        "fp32 stream: traced -> enforced",
        "logits rel err vs eager / hand fix",
        "grads",
        "census fp32 (FSDP2)",
        "eager fix: stream fp32 / census fp32 / bitwise",
        "status",
    ]
    return tabulate(table, headers=headers)
