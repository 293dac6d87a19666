"""The precision half's verbs: plan, census, demo, lint, bench, sweep (what each computes lives in tools/graph_driver,
tools/census_driver, tools/bench and tools/sweep)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from fx_precision.errors import PrecisionError
from fx_precision.tools.cli.args import (
    MAX_TOKENS,
    Parser,
    Verb,
    add_batch_args,
    add_eager_fix_arg,
    add_json_arg,
    add_model_args,
    add_policy_args,
    add_rank_args,
    bounded_int,
    census_config,
    dtype_arg,
    emit,
    world_size_of,
)

if TYPE_CHECKING:
    pass


def cmd_plan(args: argparse.Namespace) -> int:
    from fx_precision.tools.graph_driver import plan_named

    plan, note = plan_named(args.model, args.rules, gather=args.gather, master=args.master, wrap=tuple(args.wrap or ()))
    emit(args, {**plan.to_dict(), "model_source": note}, lambda: (f"{note}\n" if note else "") + plan.explain())
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    """plan's flags."""
    add_model_args(p)
    p.add_argument(
        "--gather", type=dtype_arg("--gather"), default="fp32", help="default gather dtype (FSDP2 param_dtype): fp32, bf16, fp16"
    )
    p.add_argument("--master", type=dtype_arg("--master"), default=None, help="default master dtype (default: each parameter's own dtype)")


PLAN = Verb(
    "plan",
    help="lower precision rules onto a model: per-parameter dtypes and FSDP2 wrap units",
    flags=_plan_args,
    run=cmd_plan,
)


def cmd_census(args: argparse.Namespace) -> int:
    from fx_precision.ranks import launched, use_device
    from fx_precision.tools.census_driver import run_census
    from fx_precision.tools.zoo import model_note

    if args.wrap is not None:
        raise PrecisionError("census wraps each decoder layer (the per-layer FSDP2 convention); --wrap is for `plan`")
    use_device(args.device)

    ((cfg, policy, result),) = run_census([census_config(args)], world_size=world_size_of(args))
    ranks = int(os.environ["WORLD_SIZE"]) if launched() else world_size_of(args)
    data = {"model": cfg.model, "world_size": ranks, "launcher": launched(), "policy": policy, **result.to_dict()}
    kind = "NCCL (cuda)" if args.device == "cuda" else "gloo"
    note = model_note(cfg.model, cfg.build_dtype())
    data["model_source"] = note
    head = f"{cfg.model} on {ranks} {kind} rank(s); policy: {policy}" + (f"\n{note}" if note else "")
    emit(args, data, lambda: f"{head}\n{result.render(top=args.top)}")
    return 0


def _census_args(p: argparse.ArgumentParser) -> None:
    """census's flags."""
    add_model_args(p)
    add_policy_args(p)
    add_rank_args(p, min_ranks=1, default=1, what="gloo ranks to spawn (default 1; rank 0 prints)")
    add_batch_args(p)
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where each rank runs: cpu (gloo) or its own GPU (NCCL; under torchrun)"
    )
    p.add_argument("--backward", action="store_true", help="also back-propagate and record gradient dtypes")
    add_eager_fix_arg(p)
    p.add_argument("--top", type=bounded_int("--top", 1, 100_000), default=15, help="modules to list (by fp32 count)")


CENSUS = Verb(
    "census",
    help="eager module-IO dtype inventory of one forward under FSDP2 on N gloo ranks",
    flags=_census_args,
    run=cmd_census,
)


def cmd_demo(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from fx_precision.tools.census_driver import demo_configs, demo_rows, run_census

    rows = demo_rows(run_census(demo_configs(args.model), world_size=1))

    def table() -> str:
        both = next(r for r in rows if r["policy"] == "both fixes")
        grid = tabulate(
            [[r["policy"], r["float_tensors"], r["fp32"], r["bf16"], f"{r['fp32_share']:.0%}", r["meaning"]] for r in rows],
            headers=["policy", "float tensors", "fp32", "bf16", "fp32 share", "what the row means"],
        )
        return (
            f"{args.model} under FSDP2 (1 gloo rank), fp32 master, fp32 gather: dtypes of every module input/output tensor\n\n{grid}\n"
            f"\nint64 tensors with both fixes: {len(both['int64_paths'])}, all token/position ids: {', '.join(both['int64_paths'])}"
        )

    emit(args, {"model": args.model, "rows": rows}, table)
    return 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    """demo's flags."""
    p.add_argument("--model", default="qwen3_5-tiny", help="model name (default qwen3_5-tiny)")
    add_json_arg(p)


DEMO = Verb(
    "demo",
    help="the Qwen3.5 reproduction: fp32 share of module IO under four policies and the default",
    description=(
        "Tiny Qwen3.5 (random init) under FSDP2 on one gloo rank, fp32 master, fp32 gather: "
        "bf16 autocast as-is, with each fix alone, with both fixes, and the default policy (no autocast)."
    ),
    flags=_demo_args,
    run=cmd_demo,
)


def cmd_lint(args: argparse.Namespace) -> int:
    from fx_precision.tools.graph_driver import lint_named

    if args.dot:
        folder = os.path.dirname(os.path.abspath(args.dot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise PrecisionError(f"--dot {args.dot}: the folder {folder} does not exist or is not writable; create it or pick another path")
    run = lint_named(census_config(args), wrap=tuple(args.wrap or ()), meta=args.meta, dynamic=args.dynamic, device_type=args.device_type)
    if args.dot:
        with open(args.dot, "w") as f:
            f.write(run.report.to_dot())
    head = f"{args.model}{' (meta)' if run.meta else ''}; policy: {run.policy}" + (f"\n{run.note}" if run.note else "")
    emit(args, {**run.report.to_dict(), "model_source": run.note}, lambda: f"{head}\n{run.report.render()}")
    return 1 if run.report.reaches(args.fail_on) else 0


def _lint_args(p: argparse.ArgumentParser) -> None:
    """lint's flags."""
    add_model_args(p)
    add_policy_args(p)
    add_batch_args(p)
    p.add_argument("--dynamic", action="store_true", help="trace with dynamic shapes (wide bytes as a sympy expression)")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (no weights); implied for qwen3_5-4b")
    p.add_argument("--device-type", default="cpu", choices=["cpu", "cuda"], help="whose autocast op lists apply (default cpu)")
    p.add_argument("--fail-on", default="error", choices=["info", "warn", "error"], help="exit 1 when a finding reaches this severity")
    p.add_argument("--dot", metavar="FILE", help="write the module-level dtype flow as Graphviz DOT")


LINT = Verb(
    "lint",
    help="FX-graph dtype analysis: sources of wide dtypes, cause chains; exit 1 at --fail-on",
    description=(
        "Captures the model's Dynamo graph(s) on one device (no FSDP2; the plan's gathers are emulated) "
        "under the policy's autocast and reports findings (--cast-forward-inputs only matters under FSDP2: see census). "
        "Exit status 1 when a finding reaches --fail-on."
    ),
    flags=_lint_args,
    run=cmd_lint,
)


def cmd_bench(args: argparse.Namespace) -> int:
    from fx_precision.ranks import require_device
    from fx_precision.tools.bench import render, run_benchmark

    require_device(args.device)
    quick = args.quick
    result = run_benchmark(
        model_name=args.model or ("qwen3_5-tiny" if quick else "qwen3_5-4b-slice"),
        batch=args.batch or (2 if quick else 1),
        seq_len=args.seq_len or (64 if quick else 128),
        steps=args.steps or 5,
        device=args.device,
    )
    result["command"] = " ".join(("fx-precision", *Parser.argv))
    emit(args, result, lambda: render(result))
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    """bench's flags."""
    p.add_argument("--model", default=None, help="model name (default qwen3_5-4b-slice; --quick: qwen3_5-tiny)")
    p.add_argument("--batch", type=bounded_int("--batch", 1, 4096), default=None, help="batch size (default 1; --quick: 2)")
    p.add_argument(
        "--seq-len", type=bounded_int("--seq-len", 1, MAX_TOKENS), default=None, help="sequence length (default 128; --quick: 64)"
    )
    p.add_argument("--steps", type=bounded_int("--steps", 1, 10_000), default=None, help="timed steps after warm-up (default 5)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (cuda times with CUDA events)")
    p.add_argument("--quick", action="store_true", help="tiny Qwen3.5, small batch: minutes on a CPU")
    add_json_arg(p)


BENCH = Verb(
    "bench",
    help="fwd+bwd throughput, kernels and bytes: eager, default Inductor, precision_backend, pure-bf16 limit",
    description=(
        "Runs every variant (fp32 master, bf16 autocast) in this process and prints what it measured. "
        "Default model: the Qwen3.5-4B slice (4B layer dimensions, one linear- and one full-attention layer)."
    ),
    flags=_bench_args,
    run=cmd_bench,
)


def cmd_sweep(args: argparse.Namespace) -> int:
    from fx_precision.tools.sweep import render, run_sweep

    rows = run_sweep(args.arch or None, census=not args.no_census)
    emit(args, {"command": " ".join(("fx-precision", *Parser.argv)), "rows": rows}, lambda: render(rows))
    failed = [r["arch"] for r in rows if "error" in r or r.get("enforce", {}).get("errors_after")]
    if failed:
        print(f"\nnot compatible: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _sweep_args(p: argparse.ArgumentParser) -> None:
    """sweep's flags."""
    p.add_argument("--arch", action="append", default=None, metavar="NAME", help="architecture (repeatable; default: all)")
    add_json_arg(p)
    p.add_argument("--no-census", action="store_true", help="skip the FSDP2 census (no gloo rank)")


SWEEP = Verb(
    "sweep",
    help="compatibility matrix: lint, enforce (fwd+bwd), fp32 stream tensors and FSDP2 census over tiny transformers archs",
    description=(
        "Builds each architecture of fx_precision.tools.arch_zoo from a tiny config (random init, CPU), lints it under bf16 "
        "autocast, compiles it with precision_backend (enforce, aot_eager) forward and backward, counts fp32 stream tensors as traced, "
        "after the pass and after a hand fix, and takes an FSDP2 census under resolve_policy on 1 gloo rank. Exit 1 if any "
        "architecture fails."
    ),
    flags=_sweep_args,
    run=cmd_sweep,
)
