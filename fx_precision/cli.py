"""``fx-precision``: one entry point, one verb per capability (``--json`` on every verb).

fx-precision demo      the Qwen3.5 reproduction: four policies + default, fp32 share of module IO
fx-precision plan      lower --rules onto --model and print the wrap units
fx-precision census    eager module-IO dtype inventory under FSDP2 (1..N gloo ranks)
fx-precision lint      FX-graph dtype analysis; exits 1 when findings reach --fail-on
fx-precision bench     kernel/bytes/time benchmark against default Inductor and pure bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from fx_precision.errors import PrecisionError

Handler = Callable[[argparse.Namespace], int]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="qwen3_5-tiny",
        help="built-in name (qwen3_5-tiny, qwen3_5-4b-slice, qwen3_5-4b, toy-decoder) or package.module:factory",
    )
    p.add_argument("--rules", default="", help="precision rules, e.g. '*embed_tokens=bf16; cls:*RMSNorm=gather:fp32'")
    p.add_argument(
        "--wrap",
        action="append",
        default=None,
        help="module-FQN glob whose outermost matches are FSDP2 units (repeatable; default: the decoder layers)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _default_wrap(args: argparse.Namespace, model: object) -> list[str]:
    if args.wrap is not None:
        return args.wrap
    from fx_precision.fsdp import layer_wrap_globs

    return layer_wrap_globs(model)  # type: ignore[arg-type]


def cmd_plan(args: argparse.Namespace) -> int:
    from fx_precision.plan import compile_precision
    from fx_precision.spec import parse_precision_rules
    from fx_precision.zoo import build_model

    model = build_model(args.model, device="meta")
    plan = compile_precision(
        model,
        parse_precision_rules(args.rules),
        default_gather=args.gather,
        default_master=args.master,
        wrap=args.wrap or (),
    )
    print(plan.to_json() if args.json else plan.explain())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx-precision",
        description="Per-module mixed precision for FSDP2 and torch.compile: declare, lower, see, enforce.",
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("plan", help="lower precision rules onto a model: per-parameter dtypes and FSDP2 wrap units")
    _add_model_args(p)
    p.add_argument("--gather", default="fp32", help="default gather dtype (FSDP2 param_dtype): fp32, bf16, fp16")
    p.add_argument("--master", default=None, help="default master dtype (default: each parameter's own dtype)")
    p.set_defaults(handler=cmd_plan)

    for register in _EXTRA_VERBS:
        register(sub)
    return parser


_EXTRA_VERBS: list[Callable[[argparse._SubParsersAction], None]] = []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except PrecisionError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc)}))
        print(f"fx-precision {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
