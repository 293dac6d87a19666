"""``plan`` and ``lint`` of a model named on the command line: a built-in name, a factory or a checkpoint config.

plan_named(name, rules, gather, master, wrap)     build on the meta device at the master dtype -> compile_precision
lint_named(cfg, ...)                              build (meta for the 4B and checkpoint configs, or --meta) -> the
                                                  policy -> its plan -> synthetic token ids -> lint (Dynamo's graphs);
                                                  the model's own failure while traced is one line
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fx_precision.errors import PrecisionError, first_line, precision_error_in
from fx_precision.lint import LintReport, lint
from fx_precision.lowering import compile_precision
from fx_precision.plan import PrecisionPlan
from fx_precision.spec import parse_precision_rules
from fx_precision.tools.census_driver import CensusConfig
from fx_precision.tools.zoo import build_model, forward_kwargs, is_checkpoint_path, model_note, token_batch


def plan_named(name: str, rules: str, *, gather: str, master: str | None, wrap: tuple[str, ...] = ()) -> tuple[PrecisionPlan, str | None]:
    """The plan of ``rules`` on the model ``name`` (built on the meta device, at ``master`` where given) and the note on
    where the model came from."""
    from fx_precision.dtypes import axis_dtype

    built = axis_dtype(master, "--master") if master else torch.float32  # a checkpoint: at the master dtype
    model = build_model(name, device="meta", dtype=built)
    plan = compile_precision(model, parse_precision_rules(rules), default_gather=gather, default_master=master, wrap=wrap)
    return plan, model_note(name, built)


@dataclass
class LintRun:
    """What ``lint_named`` found, and how it ran."""

    report: LintReport
    policy: str  # the policy, described
    meta: bool  # built on the meta device (no weights)
    note: str | None  # where the model came from (None: a built-in name)


def lint_named(cfg: CensusConfig, *, wrap: tuple[str, ...] = (), meta: bool = False, dynamic: bool = False,
               device_type: str = "cpu") -> LintRun:  # fmt: skip
    """Lint the model ``cfg.model`` under ``cfg``'s policy (module docstring)."""
    meta = meta or cfg.model == "qwen3_5-4b" or is_checkpoint_path(cfg.model)
    model = build_model(cfg.model, device="meta" if meta else None, dtype=cfg.build_dtype())
    policy = cfg.policy(model)
    plan = policy.plan(model, wrap=wrap)
    ids = token_batch(model, batch=cfg.batch, seq_len=cfg.seq_len)
    try:
        report = lint(model, ids, policy=policy, plan=plan, dynamic=dynamic, device_type=device_type, **forward_kwargs(model))
    except Exception as exc:  # the model's own forward failed while Dynamo traced it; the pass's own error as it is
        inner = precision_error_in(exc)
        if inner is not None:
            raise inner from None
        why = first_line(exc, limit=500)
        raise PrecisionError(f"tracing the forward of {type(model).__name__} raised {type(exc).__name__}: {why}") from exc
    return LintRun(report, policy.describe(), meta, model_note(cfg.model, cfg.build_dtype()))
