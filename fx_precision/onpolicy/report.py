"""How an on-policy run reads: the per-step table, the summary line, and the plot of reward and mismatch per step.

table(run)            one row per step (tabulate): mismatches of the sampled tokens, max |delta|, ratio min / max,
                      k3 KL, reward, loss, the time split; then each step's figures under TRL's, verl's and slime's names
summary_line(run)     steps without a mismatch, the reward's first and last three steps, the median step time
plot(runs, file)      a PNG: reward per step (top) and mismatched tokens per step (bottom), one line per run
                      (e.g. --contract vllm beside --contract none); matplotlib, the optional ``plot`` extra
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.metrics import OnPolicyRun


def table(run: OnPolicyRun) -> str:
    """The per-step table, then the same steps under the names RL frameworks log them by (``STANDARD_NAMES``: TRL's,
    verl's, slime's), so a run reads in a dashboard's terms too."""
    from tabulate import tabulate

    rows = [s.row() for s in run.steps]
    if not rows:
        return "(no step finished)"
    standard = [{"step": s.step, **s.standard()} for s in run.steps]
    return f"{tabulate(rows, headers='keys', floatfmt='.4g')}\n\n{tabulate(standard, headers='keys', floatfmt='.4g')}"


def summary_line(run: OnPolicyRun) -> str:
    s = run.summary()
    contract = run.config.get("contract")
    return (
        f"--contract {contract}: {s['mismatch_free_steps']} of {s['steps']} steps without a mismatch ({s['mismatches']} of "
        f"{s['tokens']} sampled tokens differ); reward {s['reward_first3']:.3f} (first 3 steps) -> {s['reward_last3']:.3f} (last 3); "
        f"median step {s['median_step_seconds']:.2f} s"
    )


def origin_line(run: OnPolicyRun) -> str | None:
    """Strict mode with --modules: where the step it stopped at parts (the comparator's first origin, its op, and inside
    an MoE block the part and token), or None where none was named."""
    origin = run.origin
    if not origin:
        return None
    from fx_precision.routes import moe_origin_line

    op = f" ({origin['op']}: {origin['explanation']})" if origin.get("op") else ""
    line = f"first origin: {origin.get('module') or 'none found'}{op}"
    return line + (f"\n{moe_origin_line(origin['moe'])}" if origin.get("moe") else "")


def check_plot_path(file: str | Path) -> Path:
    """A plot is a PNG in a directory that exists: refused before the run that would draw it (nothing is created)."""
    if Path(file).suffix.lower() != ".png":
        raise PrecisionError(f"--plot {file}: a .png file (the plot is written as PNG); name it PLOT.png")
    parent = Path(file).parent
    if not parent.is_dir():
        raise PrecisionError(f"--plot {file}: {parent} is not a directory; create it or write the plot elsewhere")
    return Path(file)


def plot(runs: Sequence[tuple[str, OnPolicyRun]], file: str | Path) -> Path:
    """``runs`` (label, run) drawn into ``file`` (PNG), written whole (module docstring)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PrecisionError("--plot needs matplotlib: pip install 'fx_precision[plot]' (or pip install matplotlib)") from None
    target = check_plot_path(file)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for label, run in runs:
        steps = [s.step for s in run.steps]
        top.plot(steps, [s.reward for s in run.steps], marker="o", label=label)
        bottom.plot(steps, [s.mismatches for s in run.steps], marker="o", label=label)
    top.set_ylabel("reward (mean of the step)")
    bottom.set_ylabel("mismatched sampled tokens")
    bottom.set_xlabel("step")
    top.legend()
    bottom.set_yscale("symlog", linthresh=1)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    first = runs[0][1] if runs else None
    if first is not None:
        c = first.config
        figure.suptitle(f"on-policy RL: G={c.get('samples')}, T={c.get('temperature')}, FSDP2 x{c.get('world_size')}", fontsize=10)
    figure.tight_layout()
    tmp = target.with_name(f".{target.name}.writing")
    figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
    tmp.replace(target)
    return target
