"""The on-policy loop, measured: the step under the engine contract against the same step as users run it today.

    one checkpoint (a seeded tiny one of --arch, or a shape: --shape NAME (tests/configs) or a config directory, --layers N),
    one run per mode, the same prompts, samples, temperature, ranks and compilation:
    ├── --contract vllm   gather bf16, compute bf16, the contract's rewrites, the engine's row plans
    ├── --contract none   fp32 gather, bf16 autocast (what RL trainers run today)
    └── --replay-routes   (a mixture of experts) also --contract none with the engine's routes replayed (routes.py)
    per run: mismatched sampled tokens per step, the reward, and the time split (sync, rollout, probe, recompute,
    train, save); the cost is the median step (steps 1.., step 0 compiles) with the contract over the one without,
    and the trainer's part alone (recompute + train)

Run from the main environment (the engine environment from ``python -m fx_precision.tools.engine_env``):

    python benchmarks/onpolicy.py --engine-python .venv-engine/bin/python [--arch qwen3] [--steps 10]
        [--temperature 1.0] [--engine-launch defaults|eager] [--json benchmarks/results/onpolicy-cpu.json]
        [--plot benchmarks/results/onpolicy-cpu.png]

Prints a table of both runs; JSON with the machine, the versions and the command.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import cpu_model, provenance  # benchmarks/provenance.py
from tabulate import tabulate

from fx_precision.onpolicy import EngineLaunch, OnPolicyConfig, OnPolicyRun, Sampling, Training, run_onpolicy
from fx_precision.onpolicy.report import plot, summary_line
from fx_precision.tools.checkpoint import write_shaped_checkpoint, write_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "configs"
MODES = ("vllm", "none")


def label(run: OnPolicyRun) -> str:
    """The run's trainer as its flags say it."""
    return f"--contract {run.config['contract']}" + (" --replay-routes" if run.config.get("replay_routes") else "")


def row(run: OnPolicyRun) -> dict[str, Any]:
    s = run.summary()
    return {
        "contract": run.config["contract"] + (" + replayed routes" if run.config.get("replay_routes") else ""),
        "steps": s["steps"],
        "steps without mismatch": s["mismatch_free_steps"],
        "mismatched tokens": f"{s['mismatches']} / {s['tokens']}",
        "reward first 3 -> last 3": f"{s['reward_first3']:.3f} -> {s['reward_last3']:.3f}",
        "step s (median)": round(run.median_seconds("step"), 3),
        "trainer s (recompute + train)": round(run.median_seconds("recompute", "train"), 3),
        "sync s": round(run.median_seconds("sync"), 3),
        "rollout s": round(run.median_seconds("rollout"), 3),
        "probe s": round(run.median_seconds("probe"), 3),
        "save s": round(run.median_seconds("save"), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-python", default=".venv-engine/bin/python")
    parser.add_argument("--arch", default="qwen3", help="a tiny checkpoint of this architecture (default qwen3)")
    parser.add_argument("--shape", help="a shape instead (tests/configs/NAME, or a directory holding a config.json), with --layers")
    parser.add_argument("--replay-routes", action="store_true", help="a mixture of experts: also --contract none with replayed routes")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-lens", default="8,12,16,24")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--engine-launch", choices=("defaults", "eager"), default="defaults",
                        help="the engine as users launch it (default, as the loop's), or the diagnostic eager engine")  # fmt: skip
    parser.add_argument("--json", help="write the measurement here")
    parser.add_argument("--plot", help="write reward and mismatch per step of both runs here (PNG)")
    args = parser.parse_args()
    started = time.perf_counter()
    runs: dict[str, OnPolicyRun] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.shape:
            config = Path(args.shape) if Path(args.shape).is_dir() else CONFIGS / args.shape
            checkpoint = write_shaped_checkpoint(config, root / "ckpt", layers=args.layers, seed=5)
        else:
            checkpoint = write_tiny_checkpoint(args.arch, root / "ckpt", seed=5)
        for name in (*MODES, "replayed") if args.replay_routes else MODES:
            cfg = OnPolicyConfig(
                checkpoint=str(checkpoint), out=str(root / f"run-{name}"), steps=args.steps, mode="audit",
                sampling=Sampling(prompt_lens=tuple(int(n) for n in args.prompt_lens.split(",")), samples=args.samples,
                                  max_tokens=args.max_tokens, temperature=args.temperature),
                training=Training(world_size=args.world_size, compiled=True, contract="none" if name == "replayed" else name,
                                  replay_routes=name == "replayed"),
                engine=EngineLaunch(python=args.engine_python, launch=args.engine_launch),
            )  # fmt: skip
            runs[name] = run_onpolicy(cfg)
            print(summary_line(runs[name]), flush=True)
    rows = [row(run) for run in runs.values()]
    ratio = runs["vllm"].median_seconds("step") / runs["none"].median_seconds("step")
    trainer_ratio = runs["vllm"].median_seconds("recompute", "train") / runs["none"].median_seconds("recompute", "train")
    what = args.shape or f"tiny {args.arch}"
    print(f"\non-policy loop, {what}, FSDP2 x{args.world_size}, compiled, G={args.samples}, T={args.temperature}, torch "
          f"{torch.__version__}, {cpu_model()}")  # fmt: skip
    print(tabulate(rows, headers="keys"))
    print(f"step with the contract / without: {ratio:.3f}x (trainer alone: {trainer_ratio:.3f}x)")
    if args.plot:
        plot([(label(run), run) for run in runs.values()], args.plot)
    if args.json:
        payload = {
            **provenance(),
            "checkpoint": what,
            "step_ratio": round(ratio, 4),
            "trainer_ratio": round(trainer_ratio, 4),
            "rows": rows,
            "runs": {name: run.to_dict() for name, run in runs.items()},
            "seconds": round(time.perf_counter() - started, 1),
        }
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
    main()
