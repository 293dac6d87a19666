"""Plan-compile time against model size: the unit solver is near-linear in modules.

    nn.Sequential(Linear, LayerNorm) x N under a ModuleList, wrap=["layers.*"], two rule sets:
    three rules      every block a wrap unit, every LayerNorm a precision unit (bf16), one block at fp16
    prefix globs     the blocks numbered 1* at bf16 with their LayerNorms back at fp32, one Linear at fp16

Run: ``python benchmarks/plan_scaling.py [--modules 1500 6000 12000 50000] [--json FILE]``.
Prints what it measured in this run (best of ``--repeat``), as a table and optionally JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
from tabulate import tabulate
from torch import nn

from fx_precision import compile_precision, parse_precision_rules

RULES = "cls:LayerNorm=bf16; param:*.0.bias=master:fp32; layers.0=fp16"
CONFIGS = {"three rules": RULES, "prefix globs": "layers.1*=bf16; cls:LayerNorm=fp32; layers.7.0=fp16"}


def blocks(n_modules: int) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(max(1, n_modules // 3)))
    return model


def measure(n_modules: int, repeat: int, rules: str) -> dict[str, float | int]:
    model = blocks(n_modules)
    spec = parse_precision_rules(rules)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        plan = compile_precision(model, spec, default_gather="fp32", wrap=["layers.*"])
        times.append(time.perf_counter() - start)
    return {"modules": sum(1 for _ in model.modules()), "units": len(plan.units), "seconds": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, nargs="+", default=[1500, 6000, 12000, 50000])
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the best is reported")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    rows = [{"config": name, **measure(n, args.repeat, rules)} for name, rules in CONFIGS.items() for n in args.modules]
    for row in rows:
        row["us_per_module"] = round(1e6 * float(row["seconds"]) / int(row["modules"]), 1)
    print(f"plan compile time, torch {torch.__version__}, {platform.processor() or platform.machine()}, best of {args.repeat}")
    print(
        tabulate(
            [[r["config"], r["modules"], r["units"], f"{r['seconds']:.3f}", r["us_per_module"]] for r in rows],
            headers=["rules", "modules", "units", "seconds", "µs / module"],
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": CONFIGS, "rows": rows, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                       "command": "python benchmarks/plan_scaling.py " + " ".join(sys.argv[1:])}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
