"""The engine contract, measured against a live vLLM: as-is vs contract, and what the contract costs.

    for each architecture (a tiny seeded checkpoint, the same file on both sides):
    ├── rollout     in the engine environment, on 1 and on 2 OpenMP threads: 4 prompts (7, 40, 150, 301
    │               tokens; the last spans three KV blocks of 128), 8 sampled tokens each
    ├── compare     the training side on the engine's token ids, per row of the matrix:
    │               as-is (fp32 gather, bf16 autocast) eager | contract eager (the pass with aot_eager)
    │               | contract compiled (Inductor) | contract on FSDP2, 2 gloo ranks, eager and compiled;
    │               prompt and generated tokens bitwise, max / mean |delta|, first origin and op
    └── step time   fwd+bwd of a compiled training step (precision_backend, Inductor, bf16 gather and
                    compute), with the contract's rewrites and without: median of --steps, as a ratio

Run (from the main environment; the engine environment from ``python -m fx_precision.tools.engine_env``):

    python benchmarks/engine_contract.py --engine-python .venv-engine/bin/python \\
        [--archs qwen3,llama,...] [--threads 1,2] [--full qwen3,llama] [--json FILE]

``--full`` names the architectures that get every row (FSDP2, 2 threads); the others get as-is,
contract eager and contract compiled on 1 thread. Step times want a quiet machine: ``--steps 0`` skips
them, ``--step-time-only`` measures only them. Prints what it measured in this run as a table,
and JSON with the machine, the versions and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from fx_precision.tools.checkpoint import write_tiny_checkpoint
from fx_precision.tools.cli import main as cli

PROMPT_LENS = "7,40,150,301"


def rollout(engine_python: str, checkpoint: Path, out: Path, threads: int, max_tokens: int, split_kv: str = "default") -> dict[str, Any]:
    command = [engine_python, "-m", "fx_precision.tools.cli", "rollout", "--model", str(checkpoint), "--prompt-lens", PROMPT_LENS,
               "--max-tokens", str(max_tokens), "--threads", str(threads), "--split-kv", split_kv, "--modules", "--out", str(out),
               "--overwrite", "--json"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    data = json.loads(done.stdout)
    return {"seconds": round(time.perf_counter() - started, 1), "contract": data["contract"], "engine": data["engine"]}


def compare(checkpoint: Path, dump: Path, *extra: str) -> dict[str, Any]:
    buffer = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(buffer):
        try:
            rc = cli(["compare", "--model", str(checkpoint), "--rollout", str(dump), "--json", *extra])
        except SystemExit as exc:
            rc = exc.code
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


def step_times(checkpoint: Path, contract: dict[str, Any] | None, steps: int, batch: int, seq_len: int) -> dict[str, float]:
    """Median fwd+bwd seconds of a compiled training step, without and with the contract's rewrites."""
    import fx_precision as fxp
    from fx_precision.backend import make_precision_backend
    from fx_precision.contract import EngineContract
    from fx_precision.tools.checkpoint import load_checkpoint

    out = {}
    for name, kept in (("plain", None), ("contract", EngineContract.from_dict(contract) if contract else None)):
        if name == "contract" and kept is None:
            continue
        torch.manual_seed(0)
        model = load_checkpoint(str(checkpoint), dtype=torch.float32).train()
        policy = fxp.PrecisionPolicy(gather=torch.bfloat16, compute=torch.bfloat16, cast_forward_inputs=False, contract=kept)
        backend = make_precision_backend(policy=policy, plan=policy.plan(model), inner="inductor")
        compiled = torch.compile(model, backend=backend, dynamic=False)
        ids = torch.randint(0, int(model.config.vocab_size), (batch, seq_len), generator=torch.Generator().manual_seed(1))
        times = []
        for i in range(steps + 2):  # two warm-up steps: compilation, then the first run of the compiled code
            started = time.perf_counter()
            with policy.forward_context("cpu"):
                logits = compiled(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)
            if i >= 2:
                times.append(time.perf_counter() - started)
        out[name] = statistics.median(times)
    if "contract" in out:
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


def measure(arch: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    checkpoint = write_tiny_checkpoint(arch, root / f"ckpt-{arch}", seed=args.seed, overwrite=True)
    full = arch in args.full
    rows = []
    contract = None
    for threads in args.threads if (full and not args.step_time_only) else args.threads[:1]:
        dump = root / f"dump-{arch}-t{threads}"
        engine = rollout(args.engine_python, checkpoint, dump, threads, args.max_tokens, args.split_kv)
        base = {"arch": arch, "threads": threads, "split_kv": args.split_kv}
        if "error" in engine:
            rows.append({**base, "row": "rollout", "error": engine["error"]})
            continue
        contract = contract or engine["contract"]
        matched = engine["contract"]["evidence"]["matched"]
        info = engine["engine"]
        base["engine"] = f"vllm {info['version']} ({info['kernels']}, attention {info['attention_isa']}, {info['threads']} threads)"
        from fx_precision.contract import EngineContract

        base["contract"] = EngineContract.from_dict(engine["contract"]).describe()
        names = ROWS if (full and threads == args.threads[0]) else (SHORT if threads == args.threads[0] else ("contract eager",))
        names = () if args.step_time_only else names
        for name in names:
            result = compare(checkpoint, dump, *ROWS[name])
            rows.append({**base, "row": name, "rollout_seconds": engine["seconds"], "probes_matched": matched, **result})
            print(json.dumps(rows[-1]), flush=True)
    if args.steps and contract is not None:
        cost = step_times(checkpoint, contract, args.steps, args.batch, args.seq_len)
        rows.append({"arch": arch, "row": "step time", **cost})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        if r["row"] == "step time":
            ratio = f"contract {r.get('contract', float('nan')):.3f} s / plain {r['plain']:.3f} s = {r.get('ratio', float('nan')):.2f}x"
            body.append([r["arch"], "step time (fwd+bwd, Inductor)", "", ratio, "", "", ""])
        elif "error" in r:
            body.append([r["arch"], r["row"], r.get("threads", ""), f"not run: {r['error']}", "", "", ""])
        else:
            bitwise = f"{r['prompt_bitwise']:.1%} / {r['generated_bitwise']:.1%} ({r['sequences_bitwise']}/{r['sequences']} seq)"
            where = f"{r['origin']} ({r['op']})" if r["origin"] else ""
            body.append([r["arch"], r["row"], r["threads"], bitwise, f"{r['max']:.2g}", f"{r['mean']:.2g}", where])
    headers = ["arch", "training side", "engine threads", "bitwise prompt / generated", "max |d|", "mean |d|", "first origin (op)"]
    return tabulate(body, headers=headers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine-python", required=True, help="the engine environment's python (python -m fx_precision.tools.engine_env DIR)"
    )
    parser.add_argument("--archs", default="qwen3,llama,qwen2,mistral,gemma,phi3,granite", help="arch-zoo names, comma-separated")
    parser.add_argument("--full", default="qwen3,llama", help="architectures measured on every row (FSDP2, every thread count)")
    parser.add_argument("--threads", default="1,2", help="the engine's OpenMP threads, comma-separated (the first for every row)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per variant (0: no step time)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--split-kv", choices=["default", "on", "off"], default="default", help="the engine's split-KV attention (rollout --split-kv)"
    )
    parser.add_argument("--step-time-only", action="store_true", help="only the step-time rows (the engine probe runs, for the contract)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    args.full = set(args.full.split(",")) if args.full else set()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            rows.extend(measure(arch, args, Path(tmp)))
    print(f"\nengine contract vs live vLLM, torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads")
    print(table(rows))
    if args.json:
        payload = {
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpu": _cpu_model(),
            "prompt_lens": PROMPT_LENS,
            "max_tokens": args.max_tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
