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

Parsing and printing only. ``VERBS`` below is the table of subcommands, in the order ``--help`` lists them; each
entry (``args.Verb``) names its flags (``_<verb>_args``) and its runner (``cmd_<verb>``), which sit together in the
module of their half:

    args.py             the parser (one error convention), the flags' types, shared argument groups, ``emit`` (JSON)
    precision_verbs.py  plan, census, lint, bench, sweep, demo
    compare_verbs.py    dump, compare
    engine_verbs.py     checkpoint, rollout, onpolicy

What a verb computes lives with the code it belongs to:
tools/graph_driver (plan, lint), tools/census_driver (census, demo), tools/bench, tools/sweep, tools/compare_sides
(dump, compare's built-in sides), tools/train_side (compare against an engine dump, the first origin of a stopped
on-policy run), tools/checkpoint, engines/rollout, onpolicy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fx_precision.errors import PrecisionError, precision_error_in
from fx_precision.tools.cli.args import Handler, Parser, Verb
from fx_precision.tools.cli.compare_verbs import COMPARE, DUMP
from fx_precision.tools.cli.engine_verbs import CHECKPOINT, ONPOLICY, ROLLOUT, onpolicy_config, rollout_config
from fx_precision.tools.cli.precision_verbs import BENCH, CENSUS, DEMO, LINT, PLAN, SWEEP

__all__ = ["VERBS", "build_parser", "main", "onpolicy_config", "rollout_config"]

VERBS: tuple[Verb, ...] = (PLAN, CENSUS, LINT, BENCH, SWEEP, DUMP, COMPARE, CHECKPOINT, ROLLOUT, ONPOLICY, DEMO)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb in ``VERBS``: each its own sub-parser, its flags, its runner."""
    parser = Parser(
        prog="fx-precision",
        description="Per-module mixed precision for FSDP2 and torch.compile: declare, lower, see, enforce.",
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in VERBS:
        p = sub.add_parser(verb.name, help=verb.help, description=verb.description)
        verb.flags(p)
        p.set_defaults(handler=verb.run)
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
