"""Deriving the eager fix for a full-size config on the meta device, against linting the same config.

    for each config: build on meta at fp32 masters; lint (capture + analysis to the fixed point);
    eager_casts (the same capture and analysis in rewrite mode, mapped to module hooks)

Run: ``python benchmarks/eager_fix_derivation.py [--configs DIR ...] [--json FILE]``. Prints what it
measured in this run (best of ``--repeat``), as a table and optionally JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tabulate import tabulate

import fx_precision as fxp
from fx_precision.tools.zoo import build_model

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "configs"
DEFAULT = [str(CONFIGS / name) for name in ("llama-3-8b", "qwen3.5-4b")]


def measure(config: str, repeat: int, seq_len: int) -> dict[str, object]:
    model = build_model(config, device="meta")
    policy = fxp.PrecisionPolicy(compute=torch.bfloat16)
    plan = policy.plan(model)
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    best = {"lint": float("inf"), "eager_casts": float("inf")}
    hooks = 0
    for _ in range(repeat):
        start = time.perf_counter()
        fxp.lint(model, ids, policy=policy, plan=plan, use_cache=False)
        best["lint"] = min(best["lint"], time.perf_counter() - start)
        start = time.perf_counter()
        fix = fxp.eager_casts(model, ids, policy=policy, plan=plan, use_cache=False)
        best["eager_casts"] = min(best["eager_casts"], time.perf_counter() - start)
        hooks = len(fix.hooks)
    layers = getattr(model.config, "num_hidden_layers", None)
    return {"config": Path(config).name, "layers": layers, "hooks": hooks, **best, "ratio": best["eager_casts"] / best["lint"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT, help="checkpoint directories (config.json)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per config; the best is reported")
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    rows = [measure(c, args.repeat, args.seq_len) for c in args.configs]
    print(f"eager fix derivation vs lint on meta, torch {torch.__version__}, {platform.machine()}, best of {args.repeat}")
    print(
        tabulate(
            [[r["config"], r["layers"], r["hooks"], f"{r['lint']:.1f}", f"{r['eager_casts']:.1f}", f"{r['ratio']:.2f}"] for r in rows],
            headers=["config", "layers", "hooks", "lint s", "eager_casts s", "ratio"],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/eager_fix_derivation.py", "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
