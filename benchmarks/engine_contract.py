"""The engine contract, measured against a live vLLM: as-is vs contract, and what the contract costs.

    per CPU family the engine runs as (--isa: auto, or amx,avx512-bf16,avx512,avx2: rollout --isa, cpu_family.py)
    tiny architectures (--archs; a seeded checkpoint, the same file on both sides)
    ├── rollout     in the engine environment, on 1 and on 2 OpenMP threads: 4 prompts (7, 40, 150, 301
    │               tokens; the last spans three KV blocks of 128), 8 sampled tokens each
    └── compare     as-is (fp32 gather, bf16 autocast) eager | contract eager (the pass with aot_eager)
                    | contract compiled (Inductor) | contract on FSDP2, 2 gloo ranks, eager and compiled
    published shapes (--shapes; tests/configs/NAME with --layers decoder layers, random weights)
    ├── rollout     on each --threads (split-KV off): prompts of 11, 97, 300 and 513 tokens, 16 sampled each
    └── compare     as-is | contract eager, on the machine's threads and on 1 | compiled | FSDP2 x2
    step (--step NAME: a published shape)
    └── step time   fwd+bwd of a compiled training step (precision_backend, Inductor, bf16 gather and
                    compute) on a rollout's batch (prompts 256 + 256 sampled tokens: 2 x 512), with the
                    contract's rewrites on the dump's row plan and without: median of --steps, as a ratio

Every row reports prompt and generated tokens bitwise, max / mean |delta|, first origin and op. Run (from the
main environment; the engine environment from ``python -m fx_precision.tools.engine_env``):

    python benchmarks/engine_contract.py --engine-python .venv-engine/bin/python \\
        [--archs qwen3,llama,...] [--full qwen3,llama] [--shapes qwen3-0.6b,llama-3.2-1b,qwen2.5-0.5b]
        [--step qwen3-0.6b] [--threads 1,2] [--isa auto|amx,avx512-bf16,avx512,avx2] [--rows short|all] [--json FILE]

Step times want a quiet machine. Prints what it measured in this run as a table, and JSON with the
machine, the versions and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import provenance  # benchmarks/provenance.py
from tabulate import tabulate

from fx_precision.tools.checkpoint import write_shaped_checkpoint, write_tiny_checkpoint
from fx_precision.tools.cli import main as cli

PROMPT_LENS = "7,40,150,301"
STEP_BUDGET_S = 900.0
STEP_BUDGET_HELP = ("seconds a step may take by its lm_head's input gradient alone (measured on this CPU first): past it the "
                    "step is not timed and its row says why (on AVX2 CPUs torch's bf16 backward GEMM runs on one thread)")  # fmt: skip
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "configs"  # published configs (every dimension as released)


def rollout(engine_python: str, checkpoint: Path, out: Path, threads: int, max_tokens: int, split_kv: str = "default",
            prompt_lens: str = PROMPT_LENS, modules: bool = True, isa: str = "auto") -> dict[str, Any]:  # fmt: skip
    command = [engine_python, "-m", "fx_precision.tools.cli", "rollout", "--launch", "eager", "--model", str(checkpoint),
               "--prompt-lens", prompt_lens,
               "--max-tokens", str(max_tokens), "--threads", str(threads), "--split-kv", split_kv, *(["--modules"] if modules else []),
               "--isa", isa, "--out", str(out), "--overwrite", "--json"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    data = json.loads(done.stdout)
    return {"seconds": round(time.perf_counter() - started, 1), "contract": data["contract"], "engine": data["engine"]}


def compare(checkpoint: Path, dump: Path, *extra: str, threads: int | None = None) -> dict[str, Any]:
    """``fx-precision compare`` in this process (``threads``: the training side's torch threads for the call)."""
    buffer = io.StringIO()
    started = time.perf_counter()
    before = torch.get_num_threads()
    environ = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:  # in process, and for the ranks it spawns
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    with contextlib.redirect_stdout(buffer):
        try:
            rc = cli(["compare", "--model", str(checkpoint), "--rollout", str(dump), "--json", *extra])
        except SystemExit as exc:
            rc = exc.code
        except Exception as exc:  # a failure of one row is that row's error, not the matrix's end
            return {"error": f"compare raised {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"}
        finally:
            torch.set_num_threads(before)
            if environ is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = environ
    seconds = time.perf_counter() - started
    try:
        report = json.loads(buffer.getvalue())
    except json.JSONDecodeError:
        return {"error": f"compare exited {rc} without JSON"}
    if "error" in report:
        return {"error": report["error"][:300]}
    lp = report["logprob"] or {}
    if not lp.get("comparable"):
        return {"error": lp.get("why")}
    origin, op = report.get("first_origin"), report.get("first_op")
    return {
        "bitwise": lp["bitwise_share"],
        "prompt_bitwise": lp["prompt"]["bitwise_share"],
        "generated_bitwise": lp["generated"]["bitwise_share"],
        "sequences_bitwise": sum(s["bitwise"] for s in lp["sequences"]),
        "sequences": len(lp["sequences"]),
        "tokens": int(lp["tokens"]),
        "max": lp["max"],
        "mean": lp["mean"],
        "origin": origin["fqn"] if origin else None,
        "op": op["op_a"] if op else None,
        "seconds": round(seconds, 1),
    }


def bf16_input_gradient_rate() -> float:
    """GFLOP/s of torch's bf16 ``grad @ weight`` (a linear's input gradient, as both steps' backwards run it) on this
    process's threads: oneDNN's bf16 GEMM where the CPU has AVX-512 (or AMX), else ATen's fallback, which torch 2.13
    runs on one thread in a scalar loop (about 0.3 GFLOP/s on an AVX2 EPYC)."""
    grad, weight = torch.randn(32, 4096, dtype=torch.bfloat16), torch.randn(4096, 1024, dtype=torch.bfloat16)
    grad @ weight  # the first call: oneDNN's primitive creation
    started = time.perf_counter()
    grad @ weight
    return 2 * grad.shape[0] * grad.shape[1] * weight.shape[1] / (time.perf_counter() - started) / 1e9


def step_rows(prompt_lens: str, max_tokens: int) -> int:
    """The tokens of a step's batch: one sequence per prompt, each cut to the shortest (step_times)."""
    lens = [int(n) for n in prompt_lens.split(",")]
    return len(lens) * (min(lens) + max_tokens)


def step_out_of_budget(config: Path, rows: int, budget: float) -> dict[str, Any] | None:
    """Why a step of ``rows`` tokens at this published shape is not timed here (a row's fields), or None: the
    lm_head's input gradient alone (rows x vocab x hidden in bf16, the same work on the plain and the contract's
    step) would take over ``budget`` seconds at this CPU's rate, so neither step says anything of the contract."""
    text = json.loads(config.read_text())
    text = text.get("text_config", text)
    rate = bf16_input_gradient_rate()
    seconds = 2 * rows * text["vocab_size"] * text["hidden_size"] / rate / 1e9
    if seconds <= budget:
        return None
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return {
        "error": f"not timed: this CPU's torch runs a bf16 linear's input gradient (grad @ weight) at {rate:.2g} GFLOP/s "
        f"(oneDNN's bf16 GEMM: {'yes' if onednn else 'no'}), so the lm_head's alone ({rows} x {text['vocab_size']} x "
        f"{text['hidden_size']}) would take about {seconds / 60:.0f} min of every step, plain and contract alike "
        f"(over --step-budget {budget:g} s)",
        "bf16_input_gradient_gflops": round(rate, 3),
        "onednn_bf16": onednn,
        "lm_head_input_gradient_s": round(seconds),
    }


def step_times(checkpoint: Path, dump_dir: Path | None, steps: int) -> dict[str, Any]:
    """Median fwd+bwd seconds of a compiled training step on the engine dump's sequences (one batch), without and
    with the contract's rewrites: the contract's step computes every row in the order of the engine call that
    computed it (the dump's row plan), as an RL trainer's recompute does."""
    from fx_precision.contract import contract_of_dump
    from fx_precision.contract.batch_rows import EngineRows, row_plans
    from fx_precision.dump import load_dump
    from fx_precision.training_side import AsUsersRunIt, RunConfig, build_training_side

    dump = load_dump(str(dump_dir)) if dump_dir is not None else None
    if dump is None or isinstance(dump, dict):
        return {"error": "no engine dump for the step"}
    contract = contract_of_dump(dump)
    length = min(len(s.tokens) for s in dump.sequences)
    ids = torch.tensor([list(s.tokens[:length]) for s in dump.sequences])
    plans = row_plans(dump.sequences, dump.engine or {}, tiling=contract.kv_tiling, gdn=contract.gdn is not None)
    cut = [type(p)(p.body[:length], p.logits[: length - 1], p.kv_tiles[:length] if p.kv_tiles else None, p.gdn[:length] if p.gdn else None)
           for p in plans]  # fmt: skip
    rows = EngineRows.of(cut, contract.linears)
    out: dict[str, Any] = {"batch": list(ids.shape)}
    for name, kept in (("plain", None), ("contract", contract)):
        torch.manual_seed(0)
        torch._dynamo.reset()
        bf16 = AsUsersRunIt(gather=torch.bfloat16, compute=torch.bfloat16)  # the contract's dtypes, without its rewrites
        side = build_training_side(RunConfig(str(checkpoint), policy=bf16, contract=kept, compiled=True, inner="inductor", train=True))
        times = []
        for i in range(steps + 2):  # two warm-up steps: compilation, then the first run of the compiled code
            started = time.perf_counter()
            logits = side.logits(ids, rows if kept is not None else None)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            side.model.zero_grad(set_to_none=True)
            if i == 0:
                out[f"{name}_first_step_s"] = round(time.perf_counter() - started, 1)  # compilation (Dynamo, Inductor) included
            if i >= 2:
                times.append(time.perf_counter() - started)
        out[name] = statistics.median(times)
    out["ratio"] = out["contract"] / out["plain"]
    return out


ROWS: dict[str, tuple[str, ...]] = {
    "as-is eager": (),
    "contract eager": ("--contract", "vllm"),
    "contract compiled": ("--contract", "vllm", "--compiled"),
    "contract eager, FSDP2 x2": ("--contract", "vllm", "--world-size", "2"),
    "contract compiled, FSDP2 x2": ("--contract", "vllm", "--compiled", "--world-size", "2"),
}
SHORT = ("as-is eager", "contract eager", "contract compiled")
FAMILY_ROWS = ("as-is eager", "contract eager", "contract compiled, FSDP2 x2")  # --rows short: per family


def measure(arch: str, args: argparse.Namespace, root: Path, isa: str) -> list[dict[str, Any]]:
    checkpoint = write_tiny_checkpoint(arch, root / f"ckpt-{arch}", seed=args.seed, overwrite=True)
    full = arch in args.full and args.rows == "all"
    rows = []
    for threads in args.threads if full else args.threads[:1]:
        dump = root / f"dump-{arch}-{isa}-t{threads}"
        engine = rollout(args.engine_python, checkpoint, dump, threads, args.max_tokens, args.split_kv, isa=isa)
        base = _base(arch, threads, args.split_kv, engine)
        if "error" in engine:
            rows.append({**base, "row": "rollout", "error": engine["error"]})
            continue
        names = ROWS if (full and threads == args.threads[0]) else (SHORT if threads == args.threads[0] else ("contract eager",))
        names = FAMILY_ROWS if args.rows == "short" else names
        for name in names:
            rows.append({**base, "row": name, **compare(checkpoint, dump, *ROWS[name])})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _base(name: str, threads: int, split_kv: str, engine: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"arch": name, "threads": threads, "split_kv": split_kv}
    if "error" not in engine:
        from fx_precision.contract import EngineContract

        info = engine["engine"]
        base["engine"] = f"vllm {info['version']} ({info['kernels']}, attention {info['attention_isa']}, {info['threads']} threads)"
        base["cpu_family"] = info.get("cpu_family")
        base["contract"] = EngineContract.from_dict(engine["contract"]).describe()
        base["probes_matched"] = engine["contract"]["evidence"]["matched"]
        base["rollout_seconds"] = engine["seconds"]
    return base


SHAPE_ROWS: tuple[tuple[str, tuple[str, ...], int | None], ...] = (  # (row, compare flags, training threads: None = the machine's)
    ("as-is eager", (), None),
    ("contract eager", ("--contract", "vllm"), None),
    ("contract eager, training on 1 thread", ("--contract", "vllm"), 1),
    ("contract compiled", ("--contract", "vllm", "--compiled"), None),
    ("contract eager, FSDP2 x2", ("--contract", "vllm", "--world-size", "2"), None),
)


SHAPE_FAMILY_ROWS = (SHAPE_ROWS[0], SHAPE_ROWS[1], ("contract compiled, FSDP2 x2", ("--contract", "vllm", "--compiled", "--world-size",
                     "2"), None))  # fmt: skip


def measure_shape(name: str, args: argparse.Namespace, root: Path, isa: str) -> list[dict[str, Any]]:
    """A published shape (tests/configs/NAME, --layers layers): every row on 1 engine thread, the contract on the
    other thread counts (split-KV off: an order the contract does not follow)."""
    checkpoint = write_shaped_checkpoint(CONFIGS / name / "config.json", root / f"ckpt-{name}", layers=args.layers, seed=args.seed,
                                         overwrite=True)  # fmt: skip
    rows = []
    for threads in args.threads:
        dump = root / f"dump-{name}-{isa}-t{threads}"
        engine = rollout(args.engine_python, checkpoint, dump, threads, args.shape_max_tokens, "off", args.shape_prompt_lens, isa=isa)
        base = _base(f"{name} ({args.layers} layers)", threads, "off", engine)
        if "error" in engine:
            rows.append({**base, "row": "rollout", "error": engine["error"]})
            continue
        chosen = SHAPE_ROWS if threads == args.threads[0] else SHAPE_ROWS[1:3]
        for row, flags, training in SHAPE_FAMILY_ROWS if args.rows == "short" else chosen:
            rows.append({**base, "row": row, **compare(checkpoint, dump, *flags, threads=training)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_step(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The contract's cost: a compiled fwd+bwd step on a rollout's sequences (--step-prompt-lens, --step-max-tokens)."""
    row = {"arch": f"{name} ({args.layers} layers)", "row": "step time", "prompt_lens": args.step_prompt_lens,
           "max_tokens": args.step_max_tokens}  # fmt: skip
    rows = step_rows(args.step_prompt_lens, args.step_max_tokens)
    if slow := step_out_of_budget(CONFIGS / name / "config.json", rows, args.step_budget):
        return {**row, **slow}
    checkpoint = write_shaped_checkpoint(CONFIGS / name / "config.json", root / f"step-{name}", layers=args.layers, seed=args.seed,
                                         overwrite=True)  # fmt: skip
    dump = root / f"step-dump-{name}"
    engine = rollout(args.engine_python, checkpoint, dump, 1, args.step_max_tokens, "off", args.step_prompt_lens, modules=False)
    if "error" in engine:
        return {**row, "error": engine["error"]}
    return {**row, **step_times(checkpoint, dump, args.steps)}


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        if r["row"] == "step time" and "error" not in r:
            ratio = f"contract {r['contract']:.3f} s / plain {r['plain']:.3f} s = {r['ratio']:.2f}x"
            body.append([r["arch"], f"step time (fwd+bwd, Inductor, batch {r['batch'][0]} x {r['batch'][1]})", "", "", ratio, "", "", ""])
        elif "error" in r:  # a step over its budget says so itself ("not timed: ...")
            said = r["error"] if "lm_head_input_gradient_s" in r else f"not run: {r['error']}"
            body.append([r["arch"], r["row"], r.get("cpu_family", ""), r.get("threads", ""), said, "", "", ""])
        else:
            bitwise = f"{r['prompt_bitwise']:.1%} / {r['generated_bitwise']:.1%} ({r['sequences_bitwise']}/{r['sequences']} seq)"
            where = f"{r['origin']} ({r['op']})" if r["origin"] else ""
            body.append([r["arch"], r["row"], r.get("cpu_family", ""), r["threads"], bitwise, f"{r['max']:.2g}", f"{r['mean']:.2g}", where])
    headers = ["arch", "training side", "engine as", "engine threads", "bitwise prompt / generated", "max |d|", "mean |d|",
               "first origin (op)"]  # fmt: skip
    return tabulate(body, headers=headers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine-python", required=True, help="the engine environment's python (python -m fx_precision.tools.engine_env DIR)"
    )
    parser.add_argument("--archs", default="qwen3,llama,qwen2,mistral,gemma,phi3,granite", help="arch-zoo names, comma-separated ('' none)")
    parser.add_argument("--full", default="qwen3,llama", help="architectures measured on every row (FSDP2, every thread count)")
    parser.add_argument("--threads", default="1,2", help="the engine's OpenMP threads, comma-separated (the first for every row)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--split-kv", choices=["default", "on", "off"], default="default", help="the tiny rows' rollout --split-kv")
    parser.add_argument("--shapes", default="", help="published shapes (tests/configs names, comma-separated): qwen3-0.6b,...")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers kept of a published shape")
    parser.add_argument("--shape-prompt-lens", default="11,97,300,513")
    parser.add_argument("--shape-max-tokens", type=int, default=16)
    parser.add_argument("--step", default="", help="a published shape whose compiled fwd+bwd step is timed with and without the contract")
    parser.add_argument("--step-prompt-lens", default="256,256", help="the step's batch: these prompts ...")
    parser.add_argument("--step-max-tokens", type=int, default=256, help="... and this many sampled tokens each (batch 2 x 512)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per variant")
    parser.add_argument("--step-budget", type=float, default=STEP_BUDGET_S, help=STEP_BUDGET_HELP)
    parser.add_argument(
        "--isa", default="auto", help="the CPU families the engine runs as, comma-separated (rollout --isa; auto: this machine's own)"
    )
    parser.add_argument(
        "--rows",
        choices=["all", "short"],
        default="all",
        help="short: per family as-is, contract eager and compiled on FSDP2 x2, engine threads the first of --threads",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    args.full = set(args.full.split(",")) if args.full else set()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for isa in args.isa.split(","):
            for arch in filter(None, args.archs.split(",")):
                rows.extend(measure(arch, args, Path(tmp), isa))
            for name in filter(None, args.shapes.split(",")):
                rows.extend(measure_shape(name, args, Path(tmp), isa))
        if args.step:
            rows.append(measure_step(args.step, args, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nengine contract vs live vLLM, torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads")
    print(table(rows))
    if args.json:
        payload = {
            **provenance(),
            "prompt_lens": PROMPT_LENS,
            "max_tokens": args.max_tokens,
            "shape_prompt_lens": args.shape_prompt_lens,
            "shape_max_tokens": args.shape_max_tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
