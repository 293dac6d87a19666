"""The engine contract against vLLM as its users launch it (`rollout --launch defaults`), measured.

    per checkpoint (--archs: tiny seeded; --shapes: tests/configs/NAME at --layers decoder layers)
    ├── rollout     vLLM at its defaults: compile on (Inductor), prefix caching, chunked prefill, the machine's
    │               cores; G samples of each prompt at temperature T, no prompt log-probs (as users sample)
    └── compare     as-is (fp32 gather, bf16 autocast) eager | contract compiled (Inductor), in one process | the
                    same on FSDP2 x 2: the sampled tokens' log-probs, bitwise share and |delta|
    step (--step NAME: a published shape)
    └── step time   fwd+bwd of a compiled training step on a rollout's batch (2 prompts of 256 + 256 sampled:
                    2 x 512), with the contract's rewrites (the compiled engine's forms, the row plan) and without
    on-policy (--onpolicy-steps N: a tiny --onpolicy-arch checkpoint)
    └── the loop    `onpolicy --engine-launch defaults`, FSDP2 x 2, compiled, G = --samples at T = 0.7: --contract vllm
                    and --contract none, mismatched sampled tokens and the median step of each

Run from the main environment (the engine environment from ``python -m fx_precision.tools.engine_env``):

    python benchmarks/engine_defaults.py --engine-python .venv-engine/bin/python \\
        [--archs qwen3,llama,qwen2] [--shapes qwen3-0.6b,llama-3.2-1b,qwen2.5-0.5b] [--layers 2] [--step qwen3-0.6b]
        [--experts N] (an MoE shape cut to N experts per layer: qwen3-next-80b-a3b's 512 do not fit 24 GiB)
        (each compare runs in this process: the published shapes' long prompts want the machine's memory to themselves)
        [--onpolicy-steps 8] [--samples 4] [--temperature 1.0] [--isa auto|avx512|avx2] [--json FILE]

Prints a table; JSON with the machine, the versions and the command, written after each part ("complete": false until
the run ends, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_contract import CONFIGS, STEP_BUDGET_HELP, STEP_BUDGET_S, compare, step_out_of_budget, step_rows, step_times
from provenance import provenance  # benchmarks/engine_contract.py, benchmarks/provenance.py
from tabulate import tabulate

from fx_precision.errors import PrecisionError
from fx_precision.tools.checkpoint import EXPERT_COUNTS, check_expert_cut, write_shaped_checkpoint, write_tiny_checkpoint

STEP_PROMPT_LENS, STEP_MAX_TOKENS = "256,256", 256  # the step's batch: two prompts of 256 tokens, 256 sampled each
ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("as-is eager", ()),
    ("contract compiled", ("--contract", "vllm", "--compiled")),
    ("contract compiled, FSDP2 x2", ("--contract", "vllm", "--compiled", "--world-size", "2")),
)


def rollout_at_defaults(engine_python: str, checkpoint: Path, out: Path, args: argparse.Namespace, prompt_lens: str,
                        samples: int, max_tokens: int) -> dict[str, Any]:  # fmt: skip
    command = [engine_python, "-m", "fx_precision.tools.cli", "rollout", "--launch", "defaults", "--model", str(checkpoint),
               "--prompt-lens", prompt_lens, "--samples", str(samples), "--temperature", str(args.temperature), "--max-tokens",
               str(max_tokens), "--seed", str(args.seed), "--isa", args.isa, "--out", str(out), "--overwrite", "--json"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    data = json.loads(done.stdout)
    info = data["engine"]
    return {
        "rollout_seconds": round(time.perf_counter() - started, 1),
        "engine": f"vllm {info['version']} ({info['kernels']}, {info['threads']} threads, compiled {info['compiled']}, prefix caching "
        f"{info['prefix_caching']})",
        "contract_inductor": data["contract"].get("inductor"),
    }


def measure(name: str, checkpoint: Path, root: Path, args: argparse.Namespace, prompt_lens: str) -> list[dict[str, Any]]:
    dump = root / f"dump-{name}"
    engine = rollout_at_defaults(args.engine_python, checkpoint, dump, args, prompt_lens, args.samples, args.max_tokens)
    base = {"checkpoint": name, "prompt_lens": prompt_lens, "samples": args.samples, "temperature": args.temperature, **engine}
    if "error" in engine:
        return [{**base, "row": "rollout"}]
    rows = []
    for row, flags in ROWS:
        rows.append({**base, "row": row, **compare(checkpoint, dump, *flags)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def cut_experts(name: str, args: argparse.Namespace) -> int | None:
    """``--experts`` where the published shape NAME is an MoE one (its config names an expert count), else None."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    return args.experts if any(key in config for key in EXPERT_COUNTS) else None


def shaped(name: str, out: Path, layers: int, args: argparse.Namespace) -> Path:
    """A published shape (tests/configs/NAME) at ``layers`` layers, an MoE one cut to ``--experts`` experts per layer."""
    return write_shaped_checkpoint(CONFIGS / name / "config.json", out, layers=layers, seed=args.seed, overwrite=True,
                                   experts=cut_experts(name, args))  # fmt: skip


def measure_step(name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    cut = f", {experts} experts" if (experts := cut_experts(name, args)) else ""
    if slow := step_out_of_budget(CONFIGS / name / "config.json", step_rows(STEP_PROMPT_LENS, STEP_MAX_TOKENS), args.step_budget):
        return {"checkpoint": f"{name} ({args.step_layers} layers{cut})", "row": "step time", **slow}
    checkpoint = shaped(name, root / f"step-{name}", args.step_layers, args)
    dump = root / f"step-dump-{name}"
    engine = rollout_at_defaults(args.engine_python, checkpoint, dump, args, STEP_PROMPT_LENS, 1, STEP_MAX_TOKENS)
    row = {"checkpoint": f"{name} ({args.step_layers} layers{cut})", "row": "step time", **engine}
    if "error" in engine:
        return row
    return {**row, **step_times(checkpoint, dump, args.steps)}


def measure_onpolicy(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The on-policy loop against the engine at its defaults, with the contract and as users run it (module docstring)."""
    from onpolicy import row as loop_row  # benchmarks/onpolicy.py

    from fx_precision.onpolicy import EngineLaunch, OnPolicyConfig, Sampling, Training, run_onpolicy

    checkpoint = write_tiny_checkpoint(args.onpolicy_arch, root / "ckpt-onpolicy", seed=5, overwrite=True)
    runs = {}
    for contract in ("vllm", "none"):
        cfg = OnPolicyConfig(checkpoint=str(checkpoint), out=str(root / f"onpolicy-{contract}"), steps=args.onpolicy_steps,
                             mode="audit", sampling=Sampling(samples=args.samples, temperature=0.7),
                             training=Training(world_size=2, compiled=True, contract=contract),
                             engine=EngineLaunch(python=args.engine_python, launch="defaults"))  # fmt: skip
        runs[contract] = run_onpolicy(cfg)
    ratio = runs["vllm"].median_seconds("step") / runs["none"].median_seconds("step")
    name = f"tiny {args.onpolicy_arch}"
    return [{"checkpoint": name, "row": "on-policy step", **loop_row(run), "step_ratio": round(ratio, 4)} for run in runs.values()]


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        if r["row"] == "on-policy step":
            loop = f"{r['steps without mismatch']} of {r['steps']} steps without a mismatch ({r['mismatched tokens']} tokens differ)"
            timing = f"median step {r['step s (median)']} s (contract / none {r['step_ratio']:.2f}x)"
            body.append([r["checkpoint"], f"on-policy loop, --contract {r['contract']}, FSDP2 x2", "", loop, timing, ""])
        elif r["row"] == "step time" and "error" not in r:
            ratio = f"contract {r['contract']:.3f} s / plain {r['plain']:.3f} s = {r['ratio']:.2f}x"
            body.append([r["checkpoint"], f"step (fwd+bwd, Inductor, batch {r['batch'][0]} x {r['batch'][1]})", "", ratio, "", ""])
        elif "error" in r:  # a step over its budget says so itself ("not timed: ...")
            said = r["error"] if "lm_head_input_gradient_s" in r else f"not run: {r['error']}"
            body.append([r["checkpoint"], r["row"], r.get("prompt_lens", ""), said, "", ""])
        else:
            bitwise = f"{r['generated_bitwise']:.1%} of {r['tokens']} ({r['sequences_bitwise']}/{r['sequences']} seq)"
            body.append([r["checkpoint"], r["row"], r["prompt_lens"], bitwise, f"{r['max']:.2g}", f"{r['mean']:.2g}"])
    return tabulate(body, headers=["checkpoint", "training side", "prompts", "sampled log-probs bitwise", "max |d|", "mean |d|"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-python", required=True, help="the engine environment's python")
    parser.add_argument("--archs", default="qwen3,llama,qwen2", help="tiny seeded checkpoints ('' for none)")
    parser.add_argument("--arch-prompt-lens", default="7,300,1500,1500", help="the tiny checkpoints' prompts (2,048 positions)")
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b,qwen2.5-0.5b", help="published shapes ('' for none)")
    parser.add_argument("--shape-prompt-lens", default="7,300,1500,3000", help="the published shapes' prompts")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the published shapes")
    parser.add_argument("--step", default="qwen3-0.6b", help="the published shape of the step time ('' for none)")
    parser.add_argument("--step-layers", type=int, default=3)
    parser.add_argument("--experts", type=int, help="an MoE shape's experts per layer to keep (each as published; 24 GiB holds few)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after two warm-up steps)")
    parser.add_argument("--step-budget", type=float, default=STEP_BUDGET_S, help=STEP_BUDGET_HELP)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--isa", default="auto", choices=["auto", "avx512", "avx2"],
                        help="the engine's kernel build (rollout --isa): auto, as its users launch it on this machine; avx2, the "
                        "portable build, whose GatedDeltaNet kernels the contract follows on any x86 CPU")  # fmt: skip
    parser.add_argument("--onpolicy-steps", type=int, default=8, help="steps of each on-policy run (0: none)")
    parser.add_argument("--onpolicy-arch", default="qwen3", help="the on-policy runs' tiny checkpoint")
    parser.add_argument("--json", metavar="FILE", help="write the rows and their provenance here")
    args = parser.parse_args(argv)
    for name in filter(None, [*args.shapes.split(","), args.step]):  # a bad --experts: refused before anything runs
        if cut_experts(name, args) is not None:
            try:
                check_expert_cut(CONFIGS / name / "config.json", args.experts)
            except PrecisionError as exc:
                parser.error(f"{name}: {exc}")
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()

    def save(complete: bool) -> None:  # after every part: a run cut short keeps what it measured, marked incomplete
        if args.json:
            out = {**provenance(), "minutes": round((time.perf_counter() - started) / 60, 1), "complete": complete, "rows": rows}
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="fxp-engine-defaults-") as tmp:
        root = Path(tmp)
        for arch in filter(None, args.archs.split(",")):
            checkpoint = write_tiny_checkpoint(arch, root / f"ckpt-{arch}", seed=args.seed, overwrite=True)
            rows += measure(f"tiny {arch}", checkpoint, root, args, args.arch_prompt_lens)
            save(False)
        for shape in filter(None, args.shapes.split(",")):
            checkpoint = shaped(shape, root / f"ckpt-{shape}", args.layers, args)
            cut = f", {experts} experts" if (experts := cut_experts(shape, args)) else ""
            rows += measure(f"{shape} ({args.layers} layers{cut})", checkpoint, root, args, args.shape_prompt_lens)
            save(False)
        if args.step:
            rows.append(measure_step(args.step, root, args))
            save(False)
        if args.onpolicy_steps:
            rows += measure_onpolicy(root, args)
    print(table(rows))
    save(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
