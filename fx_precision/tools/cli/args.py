"""The CLI's shared parts: the parser (one error convention), the flags' types, the argument groups several verbs
declare, and the JSON convention every verb follows (``emit``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fx_precision.errors import PrecisionError
from fx_precision.tools.zoo import MODEL_HELP

if TYPE_CHECKING:
    from fx_precision.tools.census_driver import CensusConfig


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


@dataclass(frozen=True)
class Verb:
    """One subcommand of the CLI's table (``VERBS`` in ``tools/cli/__init__.py``): its name, the line ``--help`` lists
    it by, the description its own ``--help`` opens with, the function that declares its flags and the one that runs it
    (arguments -> one call -> its table or JSON; the exit status)."""

    name: str
    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    run: Handler
    description: str | None = None


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


def max_ranks() -> int:
    """Gloo ranks this machine can hold: one per core, and about 1 GiB of memory each."""
    cores = os.cpu_count() or 1
    try:
        memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = float(cores)
    return max(1, min(cores, int(memory_gib)))


RANKS_WHY = "at most one gloo rank per core and per GiB of memory on this machine; under torchrun the launcher decides"


MAX_TOKENS = 1 << 20


def add_out_args(p: argparse.ArgumentParser, what: str) -> None:
    """--out DIR and --overwrite for a verb that writes a directory (a dump or a checkpoint), written whole."""
    p.add_argument("--out", required=True, metavar="DIR", help=f"{what} directory (written atomically, whole)")
    article = "an" if what[:1] in "aeiou" else "a"
    p.add_argument("--overwrite", action="store_true", help=f"replace {article} {what} already at --out, whole")


def json_target(text: str) -> str:
    """--json FILE: a file in a writable directory, checked before the command runs (not after a long run)."""
    parent = Path(text).expanduser().resolve().parent
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name the JSON file to write")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{parent} is not a writable directory; pick a path you can write to")
    return text


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        type=json_target,
        metavar="FILE",
        help="--json: print JSON instead of the table; --json FILE: write JSON to FILE and print the table",
    )


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
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


def add_model_args(p: argparse.ArgumentParser) -> None:
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
    add_json_arg(p)


def add_policy_args(p: argparse.ArgumentParser) -> None:
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


def add_eager_fix_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eager-fix",
        action="store_true",
        help="derive the backend's casts for this model and policy and register them as module hooks (fxp.eager_casts): "
        "the precision fix without torch.compile",
    )


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=bounded_int("--batch", 1, 4096), default=2, help="synthetic batch size (token ids from a fixed seed)")
    p.add_argument(
        "--seq-len",
        type=bounded_int("--seq-len", 1, MAX_TOKENS, "and at most the model's max_position_embeddings"),
        default=16,
        help="synthetic sequence length",
    )


def census_config(args: argparse.Namespace) -> CensusConfig:
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
        mesh=mesh_of(args),
        eager_fix=getattr(args, "eager_fix", False),
    )


def add_rank_args(p: argparse.ArgumentParser, *, min_ranks: int, default: int, what: str) -> None:
    """``--world-size`` and ``--mesh``, declared once for every verb that runs ranks."""
    p.add_argument("--world-size", type=bounded_int("--world-size", min_ranks, max_ranks, RANKS_WHY), default=None, help=what)
    p.add_argument("--mesh", metavar="RxS", help="HSDP: a 2-D mesh of R replicas x S shards (R*S ranks; --world-size may say the same)")
    p.set_defaults(default_world_size=default)


def mesh_of(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--mesh RxS`` (HSDP) as (replicas, shards), or None."""
    from fx_precision.ranks import parse_mesh

    text = getattr(args, "mesh", None)
    return parse_mesh(text) if text else None


def world_size_of(args: argparse.Namespace) -> int:
    """The ranks to run: the mesh's when ``--mesh`` is given (and ``--world-size``, if given too, must
    agree), else ``--world-size``, else the verb's default. Never changes ``args``."""
    shape = mesh_of(args)
    given = getattr(args, "world_size", None)
    if shape is None:
        return given if given is not None else getattr(args, "default_world_size", 0)
    ranks = shape[0] * shape[1]
    if given is not None and given != ranks:
        raise PrecisionError(f"--mesh {args.mesh} is {ranks} ranks but --world-size is {given}; give one or make them agree")
    if ranks > max_ranks():
        raise PrecisionError(f"--mesh {args.mesh} needs {ranks} ranks; this machine holds at most {max_ranks()} ({RANKS_WHY})")
    return ranks


def finite_nonnegative(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"takes a finite number >= 0, got {text!r}")
    return value


def add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top-k", type=bounded_int("--top-k", 0, 2**31 - 1), default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument(
        "--top-p", type=bounded_float("--top-p", 0.0, 1.0), default=1.0,
        help="sample among the fewest most likely tokens whose probabilities sum past p (1: all; must be above 0); the processed "
        "log-probs are renormalised over what top-k and top-p keep, and the training side computes them so",
    )  # fmt: skip


def prompt_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of prompt lengths, e.g. 7,40,150,301; got {text!r}") from None
    if not lengths or any(n < 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"every prompt length must be at least 1, got {text!r}")
    return lengths
