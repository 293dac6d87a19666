"""The comparator's verbs: dump (one forward's module calls to a directory) and compare (where two forwards part; the
sides come from tools/compare_sides, or tools/train_side against an engine dump)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fx_precision.errors import PrecisionError
from fx_precision.tools.cli.args import (
    Verb,
    add_batch_args,
    add_eager_fix_arg,
    add_model_args,
    add_out_args,
    add_policy_args,
    add_rank_args,
    census_config,
    emit,
    finite_nonnegative,
    mesh_of,
    world_size_of,
)

if TYPE_CHECKING:
    from fx_precision.training_side import RunConfig


def _side_config(args: argparse.Namespace, inputs: bool = True, *, engine_dump: bool = False) -> RunConfig:
    """The training side's RunConfig from the flags: a built-in side (the model by name, on the --batch x --seq-len token
    batch), or, against an engine dump, the checkpoint the engine ran (on the dump's sequences)."""
    from fx_precision.tools.compare_sides import built_in_side
    from fx_precision.training_side import RunConfig

    if args.wrap is not None:
        raise PrecisionError(f"{args.verb} wraps each decoder layer under FSDP2 (--world-size N); --wrap is for `plan`")
    if getattr(args, "inner", "inductor") != "inductor" and not args.compiled:
        raise PrecisionError("--inner is the backend's inner compiler with --compiled; add --compiled or drop --inner")
    flags = census_config(args).flags()
    side = RunConfig(args.model, policy=flags, compiled=getattr(args, "compiled", False), inner=getattr(args, "inner", "inductor"),
                     world_size=world_size_of(args), mesh=mesh_of(args), record_inputs=inputs,
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
    emit(
        args,
        data,
        lambda: f"wrote {args.out}: {ranks} rank(s), {data['records']} tensors of {data['calls']} module calls ({data['source']})",
    )
    return 0


def _dump_args(p: argparse.ArgumentParser) -> None:
    """dump's flags."""
    add_model_args(p)
    add_policy_args(p)
    add_batch_args(p)
    add_eager_fix_arg(p)
    add_out_args(p, "dump")
    p.add_argument("--inputs", action="store_true", help="also record every call's inputs (compare needs them for origins)")
    add_rank_args(p, min_ranks=0, default=0, what="0 (default): one process, no FSDP2; N: FSDP2 on N gloo ranks")


DUMP = Verb(
    "dump",
    help="record every module call's outputs (inputs with --inputs) of one forward under a policy, to a directory",
    description=(
        "Builds --model (fp32 masters rounded to bf16), runs one forward under the policy (--gather, --compute, --rules; "
        "--world-size N: FSDP2 on N gloo ranks, each writing OUT/rank<r>) and writes the dump: manifest.json and tensors/."
    ),
    flags=_dump_args,
    run=cmd_dump,
)


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
    emit(args, data, lambda: f"{head}\n\n{result.render()}")
    if args.fail_above is not None:
        unfollowed = f"the contract does not follow the whole run: {notes[0]}" if args.contract and notes else None
        failure = gate(lp, args.fail_above) or unfollowed
        if failure is not None:
            print(f"fx-precision compare: --fail-above {args.fail_above:g}: {failure}", file=sys.stderr)
            return 1
    return 0


def _compare_args(p: argparse.ArgumentParser) -> None:
    """compare's flags."""
    p.add_argument("dumps", nargs="*", metavar="DIR", help="two dump directories; none: the built-in sides")
    add_model_args(p)
    add_policy_args(p)
    add_eager_fix_arg(p)
    add_batch_args(p)
    p.set_defaults(batch=2, seq_len=32)
    p.add_argument("--rollout", default="bf16", help="'bf16' (the stand-in) or a dump directory (default bf16)")
    add_rank_args(p, min_ranks=0, default=0, what="train side: 0 (default) one process, N: FSDP2 on N gloo ranks")
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


COMPARE = Verb(
    "compare",
    help="where two forwards part: the first origin module and op, per-token log-prob |delta|, K3 KL",
    description=(
        "Compares two dumps (A B), or the built-in sides: --model under a training policy (side a) against "
        "--rollout bf16 (the same weights in bf16, eager, no autocast: a stand-in for an inference engine) or a dump directory. "
        "Exit 1 with --fail-above X when the max per-token log-prob |delta| exceeds X."
    ),
    flags=_compare_args,
    run=cmd_compare,
)
