"""``fx-precision``: one entry point, one verb per capability.

One JSON convention on every verb: ``--json`` prints the verb's JSON on stdout instead of its
table; ``--json FILE`` writes the JSON to FILE and prints the table. Errors exit 2 with one line
on stderr, and with ``--json`` in either form also ``{"error": ...}`` on stdout.

fx-precision demo      the Qwen3.5 reproduction: four policies + default, fp32 share of module IO
fx-precision plan      lower --rules onto --model and print the wrap units
fx-precision census    eager module-IO dtype inventory under FSDP2 (1..N gloo ranks)
fx-precision lint      FX-graph dtype analysis; exits 1 when findings reach --fail-on
fx-precision bench     kernel/bytes/time benchmark against default Inductor and pure bf16
fx-precision sweep     compatibility matrix over tiny transformers architectures
fx-precision dump      every module call's outputs of one forward, to a directory (N ranks: one per rank)
fx-precision compare   where two forwards part: first origin module and op, log-prob |delta|, K3 KL
fx-precision checkpoint  a seeded random checkpoint of an arch-zoo architecture, bf16, for both sides
fx-precision rollout   a real engine (vLLM) on token ids: log-probs, sampled tokens, modules, its contract
fx-precision onpolicy  an RL loop: FSDP2 trainer + live engine, weights synced each step, log-probs certified bitwise

Parsing and printing only: each verb is ``cmd_<verb>`` (arguments -> one call -> its table or JSON) beside
``_<verb>_parser`` (its flags), listed in VERB_PARSERS. What a verb computes lives with the code it belongs to:
tools/graph_driver (plan, lint), tools/census_driver (census, demo), tools/bench, tools/sweep, tools/compare_sides
(dump, compare's built-in sides), tools/train_side (compare against an engine dump, the first origin of a stopped
on-policy run), tools/checkpoint, engines/rollout, onpolicy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fx_precision.engines import live_engines
from fx_precision.engines.adapter import DEFAULT_LAUNCH, LAUNCHES, RolloutConfig
from fx_precision.engines.vllm.cpu_family import ISA_CHOICES
from fx_precision.errors import PrecisionError, precision_error_in
from fx_precision.tools.zoo import MODEL_HELP

if TYPE_CHECKING:
    from fx_precision.tools.census_driver import CensusConfig
    from fx_precision.training_side import RunConfig

Handler = Callable[[argparse.Namespace], int]
STDOUT = "-"


class Parser(argparse.ArgumentParser):
    """Argument errors follow the verbs' error convention: one line on stderr (with the usage), exit
    2, and ``{"error": ...}`` on stdout when ``--json`` is on the command line being parsed."""

    argv: tuple[str, ...] = ()  # the command line ``main`` parses (its argv, else sys.argv[1:])

    def error(self, message: str) -> NoReturn:
        if any(arg == "--json" or arg.startswith("--json=") for arg in Parser.argv):
            print(json.dumps({"error": f"{self.prog}: {message}"}))
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def bounded_int(name: str, low: int, high: int | Callable[[], int], why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], or an error naming the limit (``why``: where it comes from)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes an integer, got {text!r}") from None
        top = high() if callable(high) else high
        if not low <= value <= top:
            raise argparse.ArgumentTypeError(f"{name} {value} is outside {low}..{top}{' (' + why + ')' if why else ''}")
        return value

    return parse


def bounded_float(name: str, low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high], or an error naming the limit."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, got {text!r}") from None
        if not low <= value <= high:  # NaN fails both
            raise argparse.ArgumentTypeError(f"{name} {text} is outside {low:g}..{high:g}")
        return value

    return parse


def dtype_arg(flag: str, *, compute: bool = False, none: bool = False) -> Callable[[str], str | None]:
    """An argparse type: a precision dtype by any of its names, given back canonical (``bfloat16`` -> ``bf16``), or an
    error naming the flag and the dtypes the axis takes; with ``none``, ``none`` means no dtype (None)."""

    def parse(text: str) -> str | None:
        from fx_precision.dtypes import AXIS_DTYPES, COMPUTE_DTYPES, axis_dtype, dtype_name

        if none and text.strip().lower() in ("none", ""):
            return None
        try:
            return dtype_name(axis_dtype(text, flag, COMPUTE_DTYPES if compute else AXIS_DTYPES))
        except PrecisionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _max_ranks() -> int:
    """Gloo ranks this machine can hold: one per core, and about 1 GiB of memory each."""
    cores = os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = float(cores)
    return max(1, min(cores, int(memory_gib)))


RANKS_WHY = "at most one gloo rank per core and per GiB of memory on this machine; under torchrun the launcher decides"
MAX_TOKENS = 1 << 20


def _add_out_args(p: argparse.ArgumentParser, what: str) -> None:
    """--out DIR and --overwrite for a verb that writes a directory (a dump or a checkpoint), written whole."""
    p.add_argument("--out", required=True, metavar="DIR", help=f"{what} directory (written atomically, whole)")
    article = "an" if what[:1] in "aeiou" else "a"
    p.add_argument("--overwrite", action="store_true", help=f"replace {article} {what} already at --out, whole")


def _json_target(text: str) -> str:
    """--json FILE: a file in a writable directory, checked before the command runs (not after a long run)."""
    parent = Path(text).expanduser().resolve().parent
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name the JSON file to write")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{parent} is not a writable directory; pick a path you can write to")
    return text


def _add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        type=_json_target,
        metavar="FILE",
        help="--json: print JSON instead of the table; --json FILE: write JSON to FILE and print the table",
    )


def _emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    """The JSON convention (module docstring): ``data`` as JSON, ``text()`` as the table. JSON is
    strict: a non-finite float is written as the string "NaN" / "Infinity"."""
    from fx_precision.compare import json_safe

    document = json.dumps(json_safe(json.loads(json.dumps(data, default=str))), indent=2, allow_nan=False)
    if args.json == STDOUT:
        print(document)
        return
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(document)
        except OSError as exc:
            raise PrecisionError(f"--json {args.json}: cannot write it ({exc.strerror or exc}); pick a writable path") from None
    print(text())


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="qwen3_5-tiny",
        help=MODEL_HELP,
    )
    p.add_argument("--rules", default="", help="precision rules, e.g. '*embed_tokens=bf16; cls:*RMSNorm=gather:fp32'")
    p.add_argument(
        "--wrap",
        action="append",
        default=None,
        help="module-FQN glob whose outermost matches are FSDP2 units (repeatable; default none: the root and precision units only)",
    )
    _add_json_arg(p)


def cmd_plan(args: argparse.Namespace) -> int:
    from fx_precision.tools.graph_driver import plan_named

    plan, note = plan_named(args.model, args.rules, gather=args.gather, master=args.master, wrap=tuple(args.wrap or ()))
    _emit(args, {**plan.to_dict(), "model_source": note}, lambda: (f"{note}\n" if note else "") + plan.explain())
    return 0


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="lower precision rules onto a model: per-parameter dtypes and FSDP2 wrap units")
    _add_model_args(p)
    p.add_argument(
        "--gather", type=dtype_arg("--gather"), default="fp32", help="default gather dtype (FSDP2 param_dtype): fp32, bf16, fp16"
    )
    p.add_argument("--master", type=dtype_arg("--master"), default=None, help="default master dtype (default: each parameter's own dtype)")
    p.set_defaults(handler=cmd_plan)


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gather", type=dtype_arg("--gather"), default="fp32", help="default gather dtype (FSDP2 param_dtype)")
    p.add_argument(
        "--compute", type=dtype_arg("--compute", compute=True, none=True), default="bf16", help="autocast dtype, or 'none' for no autocast"
    )
    p.add_argument("--master", type=dtype_arg("--master", none=True), default="fp32", help="master dtype ('none': keep as loaded)")
    p.add_argument(
        "--cast-forward-inputs",
        choices=["on", "off", "auto"],
        default="auto",
        help="FSDP2 cast_forward_inputs; auto: off exactly when a compute dtype is set",
    )
    p.add_argument(
        "--arch-rules",
        action="store_true",
        help="add resolve_policy's per-architecture rules (e.g. Qwen3.5's embedding at compute dtype); off: your --rules only",
    )


def _add_eager_fix_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eager-fix",
        action="store_true",
        help="derive the backend's casts for this model and policy and register them as module hooks (fxp.eager_casts): "
        "the precision fix without torch.compile",
    )


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=bounded_int("--batch", 1, 4096), default=2, help="synthetic batch size (token ids from a fixed seed)")
    p.add_argument(
        "--seq-len",
        type=bounded_int("--seq-len", 1, MAX_TOKENS, "and at most the model's max_position_embeddings"),
        default=16,
        help="synthetic sequence length",
    )


def _census_config(args: argparse.Namespace) -> CensusConfig:
    from fx_precision.tools.census_driver import CensusConfig

    return CensusConfig(  # the dtypes are canonical names already (dtype_arg), or None
        label="census",
        model=args.model,
        gather=args.gather,
        compute=args.compute,
        master=args.master,
        rules=args.rules,
        arch_rules=args.arch_rules,
        cast_forward_inputs={"on": True, "off": False, "auto": None}[args.cast_forward_inputs],
        batch=args.batch,
        seq_len=args.seq_len,
        backward=getattr(args, "backward", False),
        mesh=_mesh(args),
        eager_fix=getattr(args, "eager_fix", False),
    )


def _add_rank_args(p: argparse.ArgumentParser, *, min_ranks: int, default: int, what: str) -> None:
    """``--world-size`` and ``--mesh``, declared once for every verb that runs ranks."""
    p.add_argument("--world-size", type=bounded_int("--world-size", min_ranks, _max_ranks, RANKS_WHY), default=None, help=what)
    p.add_argument("--mesh", metavar="RxS", help="HSDP: a 2-D mesh of R replicas x S shards (R*S ranks; --world-size may say the same)")
    p.set_defaults(default_world_size=default)


def _mesh(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--mesh RxS`` (HSDP) as (replicas, shards), or None."""
    from fx_precision.ranks import parse_mesh

    text = getattr(args, "mesh", None)
    return parse_mesh(text) if text else None


def _world_size(args: argparse.Namespace) -> int:
    """The ranks to run: the mesh's when ``--mesh`` is given (and ``--world-size``, if given too, must
    agree), else ``--world-size``, else the verb's default. Never changes ``args``."""
    shape = _mesh(args)
    given = getattr(args, "world_size", None)
    if shape is None:
        return given if given is not None else getattr(args, "default_world_size", 0)
    ranks = shape[0] * shape[1]
    if given is not None and given != ranks:
        raise PrecisionError(f"--mesh {args.mesh} is {ranks} ranks but --world-size is {given}; give one or make them agree")
    if ranks > _max_ranks():
        raise PrecisionError(f"--mesh {args.mesh} needs {ranks} ranks; this machine holds at most {_max_ranks()} ({RANKS_WHY})")
    return ranks


def cmd_census(args: argparse.Namespace) -> int:
    from fx_precision.ranks import launched, use_device
    from fx_precision.tools.census_driver import run_census
    from fx_precision.tools.zoo import model_note

    if args.wrap is not None:
        raise PrecisionError("census wraps each decoder layer (the per-layer FSDP2 convention); --wrap is for `plan`")
    use_device(args.device)

    ((cfg, policy, result),) = run_census([_census_config(args)], world_size=_world_size(args))
    ranks = int(os.environ["WORLD_SIZE"]) if launched() else _world_size(args)
    data = {"model": cfg.model, "world_size": ranks, "launcher": launched(), "policy": policy, **result.to_dict()}
    kind = "NCCL (cuda)" if args.device == "cuda" else "gloo"
    note = model_note(cfg.model, cfg.build_dtype())
    data["model_source"] = note
    head = f"{cfg.model} on {ranks} {kind} rank(s); policy: {policy}" + (f"\n{note}" if note else "")
    _emit(args, data, lambda: f"{head}\n{result.render(top=args.top)}")
    return 0


def _census_parser(sub: Any) -> None:
    p = sub.add_parser("census", help="eager module-IO dtype inventory of one forward under FSDP2 on N gloo ranks")
    _add_model_args(p)
    _add_policy_args(p)
    _add_rank_args(p, min_ranks=1, default=1, what="gloo ranks to spawn (default 1; rank 0 prints)")
    _add_batch_args(p)
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where each rank runs: cpu (gloo) or its own GPU (NCCL; under torchrun)"
    )
    p.add_argument("--backward", action="store_true", help="also back-propagate and record gradient dtypes")
    _add_eager_fix_arg(p)
    p.add_argument("--top", type=bounded_int("--top", 1, 100_000), default=15, help="modules to list (by fp32 count)")
    p.set_defaults(handler=cmd_census)


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

    _emit(args, {"model": args.model, "rows": rows}, table)
    return 0


def _demo_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the Qwen3.5 reproduction: fp32 share of module IO under four policies and the default",
        description="Tiny Qwen3.5 (random init) under FSDP2 on one gloo rank, fp32 master, fp32 gather: "
        "bf16 autocast as-is, with each fix alone, with both fixes, and the default policy (no autocast).",
    )
    p.add_argument("--model", default="qwen3_5-tiny", help="model name (default qwen3_5-tiny)")
    _add_json_arg(p)
    p.set_defaults(handler=cmd_demo)


def cmd_lint(args: argparse.Namespace) -> int:
    from fx_precision.tools.graph_driver import lint_named

    if args.dot:
        folder = os.path.dirname(os.path.abspath(args.dot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise PrecisionError(f"--dot {args.dot}: the folder {folder} does not exist or is not writable; create it or pick another path")
    run = lint_named(_census_config(args), wrap=tuple(args.wrap or ()), meta=args.meta, dynamic=args.dynamic, device_type=args.device_type)
    if args.dot:
        with open(args.dot, "w") as f:
            f.write(run.report.to_dot())
    head = f"{args.model}{' (meta)' if run.meta else ''}; policy: {run.policy}" + (f"\n{run.note}" if run.note else "")
    _emit(args, {**run.report.to_dict(), "model_source": run.note}, lambda: f"{head}\n{run.report.render()}")
    return 1 if run.report.reaches(args.fail_on) else 0


def _lint_parser(sub: Any) -> None:
    p = sub.add_parser(
        "lint",
        help="FX-graph dtype analysis: sources of wide dtypes, cause chains; exit 1 at --fail-on",
        description="Captures the model's Dynamo graph(s) on one device (no FSDP2; the plan's gathers are emulated) "
        "under the policy's autocast and reports findings (--cast-forward-inputs only matters under FSDP2: see census). "
        "Exit status 1 when a finding reaches --fail-on.",
    )
    _add_model_args(p)
    _add_policy_args(p)
    _add_batch_args(p)
    p.add_argument("--dynamic", action="store_true", help="trace with dynamic shapes (wide bytes as a sympy expression)")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (no weights); implied for qwen3_5-4b")
    p.add_argument("--device-type", default="cpu", choices=["cpu", "cuda"], help="whose autocast op lists apply (default cpu)")
    p.add_argument("--fail-on", default="error", choices=["info", "warn", "error"], help="exit 1 when a finding reaches this severity")
    p.add_argument("--dot", metavar="FILE", help="write the module-level dtype flow as Graphviz DOT")
    p.set_defaults(handler=cmd_lint)


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
    _emit(args, result, lambda: render(result))
    return 0


def _bench_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="fwd+bwd throughput, kernels and bytes: eager, default Inductor, precision_backend, pure-bf16 limit",
        description="Runs every variant (fp32 master, bf16 autocast) in this process and prints what it measured. "
        "Default model: the Qwen3.5-4B slice (4B layer dimensions, one linear- and one full-attention layer).",
    )
    p.add_argument("--model", default=None, help="model name (default qwen3_5-4b-slice; --quick: qwen3_5-tiny)")
    p.add_argument("--batch", type=bounded_int("--batch", 1, 4096), default=None, help="batch size (default 1; --quick: 2)")
    p.add_argument(
        "--seq-len", type=bounded_int("--seq-len", 1, MAX_TOKENS), default=None, help="sequence length (default 128; --quick: 64)"
    )
    p.add_argument("--steps", type=bounded_int("--steps", 1, 10_000), default=None, help="timed steps after warm-up (default 5)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (cuda times with CUDA events)")
    p.add_argument("--quick", action="store_true", help="tiny Qwen3.5, small batch: minutes on a CPU")
    _add_json_arg(p)
    p.set_defaults(handler=cmd_bench)


def cmd_sweep(args: argparse.Namespace) -> int:
    from fx_precision.tools.sweep import render, run_sweep

    rows = run_sweep(args.arch or None, census=not args.no_census)
    _emit(args, {"command": " ".join(("fx-precision", *Parser.argv)), "rows": rows}, lambda: render(rows))
    failed = [r["arch"] for r in rows if "error" in r or r.get("enforce", {}).get("errors_after")]
    if failed:
        print(f"\nnot compatible: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _sweep_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sweep",
        help="compatibility matrix: lint, enforce (fwd+bwd), fp32 stream tensors and FSDP2 census over tiny transformers archs",
        description="Builds each architecture of fx_precision.tools.arch_zoo from a tiny config (random init, CPU), lints it under bf16 "
        "autocast, compiles it with precision_backend (enforce, aot_eager) forward and backward, counts fp32 stream tensors as traced, "
        "after the pass and after a hand fix, and takes an FSDP2 census under resolve_policy on 1 gloo rank. Exit 1 if any "
        "architecture fails.",
    )
    p.add_argument("--arch", action="append", default=None, metavar="NAME", help="architecture (repeatable; default: all)")
    _add_json_arg(p)
    p.add_argument("--no-census", action="store_true", help="skip the FSDP2 census (no gloo rank)")
    p.set_defaults(handler=cmd_sweep)


def _side_config(args: argparse.Namespace, inputs: bool = True, *, engine_dump: bool = False) -> RunConfig:
    """The training side's RunConfig from the flags: a built-in side (the model by name, on the --batch x --seq-len token
    batch), or, against an engine dump, the checkpoint the engine ran (on the dump's sequences)."""
    from fx_precision.tools.compare_sides import built_in_side
    from fx_precision.training_side import RunConfig

    if args.wrap is not None:
        raise PrecisionError(f"{args.verb} wraps each decoder layer under FSDP2 (--world-size N); --wrap is for `plan`")
    if getattr(args, "inner", "inductor") != "inductor" and not args.compiled:
        raise PrecisionError("--inner is the backend's inner compiler with --compiled; add --compiled or drop --inner")
    flags = _census_config(args).flags()
    side = RunConfig(args.model, policy=flags, compiled=getattr(args, "compiled", False), inner=getattr(args, "inner", "inductor"),
                     world_size=_world_size(args), mesh=_mesh(args), record_inputs=inputs,
                     eager_fix=getattr(args, "eager_fix", False), replay_routes=getattr(args, "replay_routes", False))  # fmt: skip
    if side.replay_routes and not engine_dump:
        raise PrecisionError("--replay-routes replays an engine's recorded routes: give --rollout an engine dump of an MoE model")
    return side if engine_dump else built_in_side(side, batch=args.batch, seq_len=args.seq_len)


def cmd_dump(args: argparse.Namespace) -> int:
    from fx_precision.dump import check_out_path
    from fx_precision.tools.compare_sides import write_dump

    check_out_path(args.out, overwrite=args.overwrite)  # before any model runs
    dumps = write_dump(_side_config(args, inputs=args.inputs), args.out, overwrite=args.overwrite)
    ranks = max(dumps[0].world_size, 1)
    data = {"out": args.out, "ranks": ranks, "records": len(dumps[0].records), "calls": len(dumps[0].calls), "source": dumps[0].source}
    _emit(
        args,
        data,
        lambda: f"wrote {args.out}: {ranks} rank(s), {data['records']} tensors of {data['calls']} module calls ({data['source']})",
    )
    return 0


def _dump_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dump",
        help="record every module call's outputs (inputs with --inputs) of one forward under a policy, to a directory",
        description="Builds --model (fp32 masters rounded to bf16), runs one forward under the policy (--gather, --compute, --rules; "
        "--world-size N: FSDP2 on N gloo ranks, each writing OUT/rank<r>) and writes the dump: manifest.json and tensors/.",
    )
    _add_model_args(p)
    _add_policy_args(p)
    _add_batch_args(p)
    _add_eager_fix_arg(p)
    _add_out_args(p, "dump")
    p.add_argument("--inputs", action="store_true", help="also record every call's inputs (compare needs them for origins)")
    _add_rank_args(p, min_ranks=0, default=0, what="0 (default): one process, no FSDP2; N: FSDP2 on N gloo ranks")
    p.set_defaults(handler=cmd_dump)


BUILT_IN_SIDE_OPTIONS = ("model", "rules", "wrap", "gather", "compute", "master", "cast_forward_inputs", "arch_rules", "batch", "seq_len",
                         "rollout", "world_size", "mesh", "compiled", "eager_fix", "contract", "inner", "replay_routes")  # fmt: skip


def _given(args: argparse.Namespace, parser_defaults: dict[str, Any], names: Sequence[str]) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if hasattr(args, n) and getattr(args, n) != parser_defaults.get(n)]


def cmd_compare(args: argparse.Namespace) -> int:
    from fx_precision.compare import compare, gate
    from fx_precision.dump import is_engine_dump
    from fx_precision.routes import moe_origin, moe_origin_line, routes_summary
    from fx_precision.tools.compare_sides import describe

    if args.dumps and len(args.dumps) != 2:
        raise PrecisionError(
            f"compare takes two dump directories (A B), or none with --model for the built-in sides; got {len(args.dumps)}"
        )
    if args.dumps:
        ignored = _given(args, args.defaults, BUILT_IN_SIDE_OPTIONS)
        if ignored:
            raise PrecisionError(
                f"{', '.join(ignored)} describe the built-in sides; with two dump directories they would be ignored. Drop them, "
                "or drop the directories"
            )
        from fx_precision.engines import dump_or_engine_files
        from fx_precision.tools.compare_sides import CompareSides

        first, second = args.dumps
        sides = CompareSides(dump_or_engine_files(first), dump_or_engine_files(second), f"a: {first}\nb: {second}")
    elif is_engine_dump(args.rollout):
        from fx_precision.tools.train_side import against_engine_dump

        sides = against_engine_dump(args.rollout, _side_config(args, engine_dump=True), contract_engine=args.contract).sides()
    else:
        if args.contract:
            raise PrecisionError("--contract follows an engine: give --rollout an engine dump (fx-precision rollout writes one)")
        from fx_precision.tools.compare_sides import built_in_sides

        sides = built_in_sides(_side_config(args), args.rollout)
    a, b, head, notes = sides.a, sides.b, sides.head, sides.notes
    result = compare(a, b, fqn_map=args.map, nan_equal=args.nan_equal)
    lp = result.logprob
    if lp is not None and lp.get("comparable"):
        head += f"\ntoken ids: the same on both sides ({len(lp['sequences'])} sequence(s), checked)"
    data = {"a": describe(a), "b": describe(b), **result.to_dict()}
    if sides.routes is not None:
        data["routes"] = sides.routes
        head += "\n" + routes_summary(sides.routes)
        origin = result.first_origin
        named = moe_origin(origin.fqn, origin.call, origin.worst_output, sides.routes) if origin is not None else None
        if named is not None:
            data["moe_origin"] = named
            head += "\n" + moe_origin_line(named)
    if args.contract:
        data["contract"] = getattr(b, "contract", None)
        data["contract_notes"] = notes
    _emit(args, data, lambda: f"{head}\n\n{result.render()}")
    if args.fail_above is not None:
        unfollowed = f"the contract does not follow the whole run: {notes[0]}" if args.contract and notes else None
        failure = gate(lp, args.fail_above) or unfollowed
        if failure is not None:
            print(f"fx-precision compare: --fail-above {args.fail_above:g}: {failure}", file=sys.stderr)
            return 1
    return 0


def _compare_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="where two forwards part: the first origin module and op, per-token log-prob |delta|, K3 KL",
        description="Compares two dumps (A B), or the built-in sides: --model under a training policy (side a) against "
        "--rollout bf16 (the same weights in bf16, eager, no autocast: a stand-in for an inference engine) or a dump directory. "
        "Exit 1 with --fail-above X when the max per-token log-prob |delta| exceeds X.",
    )
    p.add_argument("dumps", nargs="*", metavar="DIR", help="two dump directories; none: the built-in sides")
    _add_model_args(p)
    _add_policy_args(p)
    _add_eager_fix_arg(p)
    _add_batch_args(p)
    p.set_defaults(batch=2, seq_len=32)
    p.add_argument("--rollout", default="bf16", help="'bf16' (the stand-in) or a dump directory (default bf16)")
    _add_rank_args(p, min_ranks=0, default=0, what="train side: 0 (default) one process, N: FSDP2 on N gloo ranks")
    p.add_argument("--compiled", action="store_true", help="train side compiled with precision_backend (records the logits only)")
    p.add_argument(
        "--inner",
        default="inductor",
        choices=["inductor", "aot_eager"],
        help="the backend's inner compiler with --compiled (default inductor)",
    )
    p.add_argument(
        "--contract",
        choices=["vllm"],
        default=None,
        help="train side follows the engine contract the --rollout dump recorded (gather and compute bf16, the graph rewritten "
        "to the engine's arithmetic; eager means the pass with aot_eager)",
    )
    p.add_argument(
        "--replay-routes",
        action="store_true",
        help="against an MoE engine dump: route each token to the experts the engine routed it to (routing replay; the router's "
        "weights and gradients stay the model's). Without it the routes are tapped and compared per layer",
    )
    p.add_argument("--map", default="", help="FQN renames, side a=side b, globs: 'self_attn=attn; model.layers.*=layers.*'")
    p.set_defaults(defaults={action.dest: action.default for action in p._actions})  # to tell what the user gave
    p.add_argument(
        "--fail-above",
        type=finite_nonnegative,
        default=None,
        metavar="X",
        help="exit 1 when the max log-prob |delta| exceeds X, or when no log-prob comparison could be made (fails closed)",
    )
    p.add_argument(
        "--nan-equal", action="store_true", help="NaN at exactly the same places on both sides counts as equal there (default: non-finite)"
    )
    p.set_defaults(handler=cmd_compare)


def finite_nonnegative(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"takes a finite number >= 0, got {text!r}")
    return value


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from fx_precision.tools.checkpoint import write_shaped_checkpoint, write_tiny_checkpoint

    if sum(x is not None for x in (args.model, args.config, args.as_qwen3_next)) != 1:
        raise PrecisionError("checkpoint takes --model ARCH (a tiny checkpoint), --config CONFIG --layers N (a published shape) or "
                             "--as-qwen3-next DIR (a Qwen3.5-MoE checkpoint laid out as Qwen3-Next)")  # fmt: skip
    if args.config is not None and args.layers is None:
        raise PrecisionError("--config writes a published shape with fewer layers: give --layers N")
    if args.config is None and (args.layers is not None or args.experts is not None):
        flag = "--layers" if args.layers is not None else "--experts"
        raise PrecisionError(f"{flag} goes with --config (a published shape); a tiny --model checkpoint has 3 layers")
    if args.as_qwen3_next is not None:
        from fx_precision.tools.gdn_layout import write_qwen3_next_layout

        out = write_qwen3_next_layout(args.as_qwen3_next, args.out, overwrite=args.overwrite)
        data = {"out": str(out), "from": args.as_qwen3_next, "files": sorted(p.name for p in out.iterdir())}
        _emit(args, data, lambda: f"wrote {out}: {args.as_qwen3_next}'s weights laid out as Qwen3-Next ({', '.join(data['files'])})")
        return 0
    if args.config is not None:
        out = write_shaped_checkpoint(args.config, args.out, layers=args.layers, seed=args.seed, overwrite=args.overwrite,
                                      experts=args.experts)  # fmt: skip
        cut = f", {args.experts} experts per MoE layer" if args.experts is not None else ""
        what = f"{args.config}'s shape with {args.layers} layer(s){cut}"
    else:
        out = write_tiny_checkpoint(args.model, args.out, seed=args.seed, overwrite=args.overwrite)
        what = f"a tiny {args.model}"
    data = {"out": str(out), "arch": args.model, "config": args.config, "layers": args.layers, "experts": args.experts, "seed": args.seed,
            "files": sorted(p.name for p in out.iterdir())}  # fmt: skip
    _emit(args, data, lambda: f"wrote {out}: {what}, seeded random weights, bf16 safetensors ({', '.join(data['files'])})")
    return 0


def _add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top-k", type=bounded_int("--top-k", 0, 2**31 - 1), default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument(
        "--top-p", type=bounded_float("--top-p", 0.0, 1.0), default=1.0,
        help="sample among the fewest most likely tokens whose probabilities sum past p (1: all; must be above 0); the processed "
        "log-probs are renormalised over what top-k and top-p keep, and the training side computes them so",
    )  # fmt: skip


def _checkpoint_parser(sub: Any) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="write a seeded random checkpoint of an arch-zoo architecture (bf16 safetensors + config) for both sides",
        description="A tiny checkpoint (--model ARCH: hidden 128, 3 layers, head_dim 32: sizes the engine's CPU attention runs), "
        "or a published shape (--config CONFIG --layers N: every dimension as the config states it, N layers, random weights "
        "with the architecture's initialisation), stored as published checkpoints are: bf16 safetensors and a config.json "
        "naming its dtype. --as-qwen3-next DIR: a Qwen3.5-MoE checkpoint's weights laid out as Qwen3-Next (vLLM runs Qwen3.5's "
        "GatedDeltaNet layer as Qwen3-Next's; where it cannot import Qwen3.5, roll out this layout and compare the Qwen3.5-MoE "
        "checkpoint against its dump: the dump's weights digest ties the two).",
    )
    p.add_argument("--model", metavar="ARCH", help="a tiny checkpoint of an architecture of fx-precision sweep (qwen3, llama, qwen2, ...)")
    p.add_argument("--as-qwen3-next", metavar="DIR", help="a Qwen3.5-MoE (text) checkpoint to write laid out as Qwen3-Next")
    p.add_argument("--config", metavar="CONFIG", help="a published model's config.json (or its directory): its every dimension")
    p.add_argument("--layers", type=bounded_int("--layers", 1, 1024), help="with --config: the decoder layers to keep")
    p.add_argument("--experts", type=bounded_int("--experts", 1, 4096),
                   help="with --config: experts per MoE layer to keep (each expert and the experts per token as published)")  # fmt: skip
    _add_out_args(p, "checkpoint")
    p.add_argument("--seed", type=bounded_int("--seed", 0, 2**31 - 1), default=0)
    _add_json_arg(p)
    p.set_defaults(handler=cmd_checkpoint)


def _prompt_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of prompt lengths, e.g. 7,40,150,301; got {text!r}") from None
    if not lengths or any(n < 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"every prompt length must be at least 1, got {text!r}")
    return lengths


def _start_as_family(isa: str) -> None:
    """Where ``--isa`` needs a variable oneDNN reads once, at its first use, and this process lacks it, run this command
    again in a process that has it from its start (cpu_family.py)."""
    from fx_precision.engines.vllm.cpu_family import family_settings
    from fx_precision.engines.vllm.session import import_vllm

    missing = {k: v for k, v in family_settings(isa).environment().items() if os.environ.get(k) != v}
    if missing:
        import_vllm()  # an environment without the engine says so here, not in a process started for it
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "fx_precision", *Parser.argv], {**os.environ, **missing})


def rollout_config(args: argparse.Namespace, prompts: tuple[tuple[int, ...], ...]) -> RolloutConfig:
    """``rollout``'s flags as the engine request the Python API takes: a flag left at its default leaves the field at
    ``RolloutConfig``'s (``--threads`` and ``--prompt-logprobs`` unset: the launch's own)."""
    return RolloutConfig(
        model=args.model, prompts=prompts, engine=args.engine, max_tokens=args.max_tokens, seed=args.seed, modules=args.modules,
        samples=args.samples, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, logprobs=args.logprobs,
        custom_ops=args.custom_ops, threads=args.threads or 0, split_kv=args.split_kv, isa=args.isa, launch=args.launch,
        prompt_logprobs=args.prompt_logprobs,
    )  # fmt: skip


def cmd_rollout(args: argparse.Namespace) -> int:
    import torch

    from fx_precision.contract import EngineContract
    from fx_precision.dump import check_out_path
    from fx_precision.engines.rollout import rollout_prompts, run_rollout

    check_out_path(args.out, overwrite=args.overwrite, sources=[args.model])  # before the engine starts
    _start_as_family(args.isa)
    prompts = rollout_prompts(args.model, args.prompts, args.prompt_lens, args.seed, args.max_tokens, args.engine, args.isa)
    dump = run_rollout(rollout_config(args, prompts))
    dump.save(args.out, overwrite=args.overwrite)
    contract = EngineContract.from_dict(dump.contract)
    engine = {k: v for k, v in (dump.engine or {}).items() if k not in ("steps", "logits_calls", "module_steps", "module_logits_calls")}
    sequences = [{"prompt_len": s.prompt_len, "tokens": len(s.tokens)} for s in dump.sequences]
    prompt_recorded = bool((dump.engine or {}).get("prompt_logprobs", True))
    values = [r.tensor if prompt_recorded else r.tensor[s.prompt_len - 1 :]
              for s, r in zip(dump.sequences, dump.logprob_records(), strict=True) if r.tensor is not None]  # fmt: skip
    non_finite = sum(int((~torch.isfinite(v)).sum()) for v in values)
    total = sum(int(v.numel()) for v in values)
    data = {"out": args.out, "engine": engine, "contract": dump.contract, "sequences": sequences, "non_finite_logprobs": non_finite}
    matched = contract.evidence.followed()
    warning = ""
    if non_finite:
        from fx_precision.checkpoints import non_finite_tensors

        bad = non_finite_tensors(args.model)
        why = f"the checkpoint holds NaN or Inf weights ({', '.join(n for n, _, _ in bad[:3])})" if bad else "the weights are finite"
        warning = f"\nNOT USABLE: {non_finite} of {total} log-probs are NaN or Inf ({why}); nothing here is a policy's log-prob"
    _emit(
        args,
        data,
        lambda: (
            f"wrote {args.out}: {len(dump.sequences)} sequence(s) from {dump.source}\ncontract: {contract.describe()}\n"
            f"probes matched: {', '.join(f'{k} {v}' for k, v in matched.items())}{warning}"
        ),
    )
    return 1 if non_finite else 0


def _rollout_parser(sub: Any) -> None:
    p = sub.add_parser(
        "rollout",
        help="run a real inference engine (vLLM, in this process) on token ids and write its dump: log-probs, tokens, contract",
        description="Run where vLLM is installed (python -m fx_precision.tools.engine_env DIR builds that environment). Samples "
        "--max-tokens per prompt with the log-prob of every prompt and generated token, probes the engine's arithmetic (the "
        "contract), and with --modules records every module's inputs and outputs under transformers names.",
    )
    p.add_argument("--engine", choices=live_engines(), default="vllm", help="the engine adapter (fx_precision/engines)")
    p.add_argument("--model", required=True, metavar="CKPT", help="a checkpoint directory (fx-precision checkpoint writes one)")
    p.add_argument("--prompts", metavar="FILE", help="a JSON list of token-id lists (default: synthetic prompts of --prompt-lens)")
    p.add_argument("--prompt-lens", type=_prompt_lengths, default=[7, 40, 150, 301], help="synthetic prompt lengths (default 7,40,150,301)")
    p.add_argument("--seed", type=bounded_int("--seed", 0, 2**31 - 1), default=1, help="seed of the synthetic prompts and of sampling")
    p.add_argument("--max-tokens", type=bounded_int("--max-tokens", 1, 4096), default=8, help="tokens sampled per prompt (default 8)")
    p.add_argument("--samples", type=bounded_int("--samples", 1, 64), default=1, help="samples of each prompt, in one call (default 1)")
    p.add_argument("--temperature", type=bounded_float("--temperature", 0.0, 10.0), default=1.0, help="sampling temperature (default 1)")
    _add_top_args(p)
    p.add_argument(
        "--logprobs", choices=["raw", "processed"], default="raw",
        help="the log-probs the engine returns: of the logits as they are (raw, vLLM's default) or as the sampler drew from "
        "them (processed: at the temperature, renormalised over --top-k / --top-p)",
    )  # fmt: skip
    p.add_argument(
        "--modules",
        action="store_true",
        help="also record every module's inputs and outputs (one prefill per sequence; --launch eager: hooks do not run in the "
        "compiled engine)",
    )
    p.add_argument(
        "--threads", type=bounded_int("--threads", 1, 256), default=None,
        help="the engine's OpenMP threads (default: 1 with --launch eager, the machine's cores with --launch defaults)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-logprobs", action=argparse.BooleanOptionalAction, default=None,
        help="ask the engine for the prompt tokens' log-probs too (default: yes with --launch eager, no with --launch defaults, "
        "as users sample: they add logits calls to the engine's steps)",
    )  # fmt: skip
    p.add_argument("--custom-ops", choices=["default", "none"], default="default", help="vLLM's custom ops (none: native torch forms)")
    p.add_argument(
        "--split-kv",
        choices=["default", "on", "off"],
        default="default",
        help="vLLM's split-KV CPU attention with --threads > 1 (default: the environment's VLLM_CPU_ATTN_SPLIT_KV, on in vLLM); "
        "the engine contract follows either (each row's split-KV parts and KV tiles, as the engine's scheduler placed them)",
    )
    p.add_argument(
        "--launch", choices=list(LAUNCHES), default=DEFAULT_LAUNCH,
        help="how vLLM is launched: defaults (the default, as users launch it: LLM(model, dtype=bfloat16, seed=S), compile "
        "on, prefix caching, chunked prefill, its cores; the contract follows it on a training side compiled by Inductor, "
        "compare --compiled) or eager (diagnosis: enforce_eager, no prefix caching, 1 thread, prompt log-probs). Either way "
        "the rollout sets, for its own needs: the engine in "
        "this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a KV cache of two sequences of its positions (at least 1 GiB), "
        "no thread binding, at most 8,192 positions, "
        "no tokenizer (token-id prompts); all recorded in the dump",
    )  # fmt: skip
    p.add_argument(
        "--isa", choices=ISA_CHOICES, default="auto",
        help="run the engine as this CPU family would (a test device for developers and CI: oneDNN's ISA cap, vLLM's kernel "
        "build and its AMX checks; recorded in the dump as engine.cpu_family). auto: this "
        "machine's own family. A family this CPU lacks the instructions of is refused",
    )  # fmt: skip
    _add_out_args(p, "dump")
    _add_json_arg(p)
    p.set_defaults(handler=cmd_rollout)


def onpolicy_config(args: argparse.Namespace) -> Any:
    """The OnPolicyConfig of ``fx-precision onpolicy``'s arguments (the API's defaults where a flag is left out)."""
    from fx_precision.engines.prompts import read_prompts
    from fx_precision.onpolicy import OnPolicyConfig

    return OnPolicyConfig(
        checkpoint=args.model, out=args.out, steps=args.steps, prompts=read_prompts(args.prompts) if args.prompts else None,
        prompt_lens=tuple(args.prompt_lens), samples=args.samples, max_tokens=args.max_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p,
        world_size=args.world_size, compiled=args.compiled, contract=args.contract, mode=args.mode, lr=args.lr,
        micro_batch=args.micro_batch, seed=args.seed, engine_python=args.engine_python, engine_threads=args.engine_threads,
        engine_launch=args.engine_launch,
        engine_timeout=args.engine_timeout, modules=args.modules, overwrite=args.overwrite, replay_routes=args.replay_routes,
    )  # fmt: skip


def cmd_onpolicy(args: argparse.Namespace) -> int:
    from fx_precision.onpolicy import run_onpolicy
    from fx_precision.onpolicy.report import check_plot_path, origin_line, plot, summary_line, table

    if args.plot is not None:
        check_plot_path(args.plot)
    cfg = onpolicy_config(args)
    run = run_onpolicy(cfg)
    if run.stopped is not None and cfg.modules:
        from fx_precision.tools.train_side import name_first_origin

        name_first_origin(run, contract=cfg.contract == "vllm")
    if args.plot is not None:
        plot([(f"--contract {cfg.contract}", run)], args.plot)
    stop = (f"\nstopped: {run.stopped}" if run.stopped else "") + (f"\n{origin_line(run)}" if origin_line(run) else "")
    _emit(args, run.to_dict(), lambda: f"{table(run)}\n{summary_line(run)}{stop}")
    return 1 if run.stopped else 0


def _onpolicy_parser(sub: Any) -> None:
    p = sub.add_parser(
        "onpolicy",
        help="an on-policy RL loop: FSDP2 trainer (fp32 masters, compiled, the engine contract) and a live vLLM, "
        "weights synced every step, the rollout's log-probs certified equal to the trainer's",
        description="Each step: the bf16 rounding of the trainer's masters synced to the engine (a memory-backed file, "
        "loaded in place, its digest checked), P prompts x G samples sampled at --temperature, the trainer's recompute and "
        "first training forward in padded micro-batches, a GRPO loss on a toy reward (the share of sampled ids divisible "
        "by 4), AdamW; the rollout, recompute and first-forward log-probs of every sampled token compared as bit "
        "patterns. --mode strict stops at the first mismatch (exit 1), audit reports and goes on. --out DIR keeps the "
        "last step's checkpoint and rollout dump (DIR/last) and metrics.json. The engine runs in its environment "
        "(--engine-python).",
    )
    p.add_argument(
        "--model", required=True, metavar="CKPT", help="the starting checkpoint directory (its bf16 weights become fp32 masters)"
    )
    p.add_argument("--steps", type=bounded_int("--steps", 1, 100_000), default=10, help="RL steps (default 10)")
    p.add_argument(
        "--prompts", metavar="FILE", help="a JSON list of token-id lists, the same every step (default: fresh synthetic prompts)"
    )
    p.add_argument(
        "--prompt-lens",
        type=_prompt_lengths,
        default=[8, 12, 16, 24],
        help="synthetic prompt lengths, drawn anew each step (default 8,12,16,24)",
    )
    p.add_argument("--samples", type=bounded_int("--samples", 1, 64), default=4, help="G: samples of each prompt (default 4)")
    p.add_argument("--max-tokens", type=bounded_int("--max-tokens", 1, 4096), default=8, help="tokens sampled per sample (default 8)")
    p.add_argument("--temperature", type=bounded_float("--temperature", 0.0, 10.0), default=1.0, help="sampling temperature (default 1)")
    _add_top_args(p)
    p.add_argument(
        "--world-size", type=bounded_int("--world-size", 1, _max_ranks, RANKS_WHY), default=2, help="FSDP2 gloo ranks (default 2)"
    )
    p.add_argument(
        "--compiled", action=argparse.BooleanOptionalAction, default=True,
        help="compile the trainer's forward with precision_backend over Inductor (default; the contract always compiles: "
        "--no-compiled runs aot_eager, which the engine at its defaults does not allow)",
    )  # fmt: skip
    p.add_argument(
        "--contract",
        choices=["vllm", "none"],
        default="vllm",
        help="follow the engine's contract (vllm) or run as users do today (none: fp32 gather, bf16 autocast)",
    )
    p.add_argument(
        "--replay-routes",
        action="store_true",
        help="an MoE model with --contract none: the trainer routes each token to the experts the engine routed it to (routing "
        "replay, R3); the router's weights and gradients stay the model's",
    )
    p.add_argument(
        "--mode", choices=["strict", "audit"], default="strict", help="strict: stop at the first mismatch; audit: report and go on"
    )
    p.add_argument(
        "--lr",
        type=bounded_float("--lr", 1e-8, 0.5),
        default=1.5e-2,
        help="AdamW learning rate (default 1.5e-2: the toy task learns in 10 steps)",
    )
    p.add_argument(
        "--micro-batch", type=bounded_int("--micro-batch", 1, 256), default=4, help="sequences per padded micro-batch (default 4)"
    )
    p.add_argument("--seed", type=bounded_int("--seed", 0, 2**31 - 1), default=0, help="seed of the prompts and of sampling")
    p.add_argument(
        "--engine-python", metavar="PYTHON", help="the engine environment's python (default: $FXP_ENGINE_PYTHON, ./.venv-engine/bin/python)"
    )
    p.add_argument(
        "--engine-threads",
        type=bounded_int("--engine-threads", 0, 256),
        default=0,
        help="the engine's OpenMP threads (default 0: the launch's own, the machine's cores at the defaults, 1 eager)",
    )
    p.add_argument(
        "--engine-launch", choices=("defaults", "eager"), default="defaults",
        help="defaults: the engine as users launch it (default: compile on, prefix caching, chunked prefill, its threads and "
        "split-KV), which the contract follows on the loop's FSDP2 trainer compiled by Inductor; the weight sync resets the "
        "prefix cache, so no step reads KV of an older policy. eager: the diagnostic engine (enforce_eager, prefix caching off, "
        "one thread, split-KV off, prompt log-probs recorded; --modules needs it)",
    )  # fmt: skip
    p.add_argument(
        "--engine-timeout", type=bounded_float("--engine-timeout", 1.0, 86400.0), default=300.0, metavar="SECONDS",
        help="the base of every engine call's time limit (default 300): probing and recording get 4x, starting 4x and at "
        "least 600 s, a generation adds 0.05 s per prompt and sampled token; an engine that does not answer in time is "
        "stopped and the run ends naming the call. A stopped or hung engine (30 s without its heartbeat) is stopped then, "
        "whatever the limit",
    )  # fmt: skip
    p.add_argument(
        "--modules", action="store_true",
        help="strict mode: the step it stops at records the engine's modules, and the comparator names the first origin "
        "(--engine-launch eager)",
    )  # fmt: skip
    p.add_argument("--plot", metavar="PNG", help="write reward and mismatch per step to this PNG (needs matplotlib)")
    _add_out_args(p, "on-policy run")
    _add_json_arg(p)
    p.set_defaults(handler=cmd_onpolicy)


VERB_PARSERS: tuple[Callable[[Any], None], ...] = (  # in the order --help lists the verbs
    _plan_parser,
    _census_parser,
    _lint_parser,
    _bench_parser,
    _sweep_parser,
    _dump_parser,
    _compare_parser,
    _checkpoint_parser,
    _rollout_parser,
    _onpolicy_parser,
    _demo_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fx-precision",
        description="Per-module mixed precision for FSDP2 and torch.compile: declare, lower, see, enforce.",
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in VERB_PARSERS:
        add(sub)
    return parser


def _where_it_stopped(args: argparse.Namespace) -> str:
    """For a stopped run that writes a directory: what it holds now."""
    out = getattr(args, "out", None)
    if not out:
        return ""
    last = Path(out) / "last"
    if last.is_symlink():
        return f"; {out} holds step {int(Path(os.readlink(last)).name)} (the last complete one)"
    return f"; no step completed, nothing was kept in {out}" if args.verb == "onpolicy" else ""


def main(argv: Sequence[str] | None = None) -> int:
    Parser.argv = tuple(argv) if argv is not None else tuple(sys.argv[1:])
    # transformers' "falling back to the reference implementation" notes are noise on CPU;
    # the variable also reaches the gloo ranks this process spawns
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(list(Parser.argv))
    from fx_precision.ranks import launcher_rank

    if launcher_rank() != 0:  # under torchrun: rank 0 speaks for all
        sys.stdout = open(os.devnull, "w")
    handler: Handler = args.handler
    from fx_precision.lifetime import Stopped

    try:
        try:
            return handler(args)
        except Stopped as exc:  # SIGTERM / SIGINT: the run's processes are stopped and its output whole; one line, 128 + signal
            print(f"fx-precision {args.verb}: {exc}{_where_it_stopped(args)}", file=sys.stderr)
            return 128 + exc.signum
        except Exception as exc:  # Dynamo wraps a backend's error (BackendCompilerFailed), a rank's comes wrapped too
            inner = precision_error_in(exc)
            if inner is None or inner is exc:
                raise
            raise inner from None
    except PrecisionError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc)}))
        print(f"fx-precision {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
