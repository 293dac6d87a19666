"""fx_precision: declare, lower, see and enforce per-module mixed precision under FSDP2 and torch.compile.

master   (what the optimizer steps on)   fp32 master, refined per parameter
gather   (what a weight carries forward)  FSDP2 param_dtype, refined per module  -> PrecisionPlan units
compute  (what ops run at)                torch.autocast dtype (+ casts the backend inserts)

PrecisionSpec ─ compile_precision ─▶ PrecisionPlan ─ apply_fsdp2 ─▶ FSDP2 model ─ census
                                          └─ lint / torch.compile(backend=precision_backend)

The package is lazy (PEP 562): ``import fx_precision`` and ``import fx_precision.spec`` load
neither Dynamo nor FSDP2; a name is imported on first use. ``torch.compile(backend="fx_precision")``
finds the backend through the ``torch_dynamo_backends`` entry point. ``census``, ``lint``, ``dump``
and ``compare`` are modules that can be called as their function (``fxp.lint(model, ids)``), so
``import fx_precision.lint`` binds the module and the package's name calls alike.

Layout: the core (spec, plan, selection, unit_solver, lowering, policy, archs, fsdp, census,
lint, backend, passes) never imports ``fx_precision.tools`` (model zoos, bench, kernel census,
rank runner, sweep, CLI).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "DEFAULT": "fx_precision.spec",
    "ModuleSel": "fx_precision.spec",
    "ParamSel": "fx_precision.spec",
    "PrecisionSpec": "fx_precision.spec",
    "Rule": "fx_precision.spec",
    "parse_precision_rules": "fx_precision.spec",
    "PrecisionError": "fx_precision.errors",
    "precision_error_in": "fx_precision.errors",
    "PrecisionPlan": "fx_precision.plan",
    "UnitPlan": "fx_precision.plan",
    "compile_precision": "fx_precision.lowering",
    "PrecisionPolicy": "fx_precision.policy",
    "resolve_policy": "fx_precision.policy",
    "apply_fsdp2": "fx_precision.fsdp",
    "Census": "fx_precision.census",
    "CensusRecorder": "fx_precision.census",
    "census": "fx_precision.census",
    "LintReport": "fx_precision.lint",
    "lint": "fx_precision.lint",
    "Finding": "fx_precision.passes.rules.findings",
    "PrecisionBackend": "fx_precision.backend",
    "dump": "fx_precision.dump",
    "DumpRecorder": "fx_precision.dump",
    "compare": "fx_precision.compare",
    "Comparison": "fx_precision.compare",
    "Side": "fx_precision.compare",
    "make_precision_backend": "fx_precision.backend",
    "eager_casts": "fx_precision.eager_fix",
    "apply_eager_fix": "fx_precision.eager_fix",
    "EagerFix": "fx_precision.eager_fix",
    "EagerHook": "fx_precision.eager_fix",
    "precision_backend": "fx_precision.backend",
    # the engine contract and the on-policy loop, for users who bring their own loop (docs/onpolicy.md)
    "EngineContract": "fx_precision.contract",
    "RunConfig": "fx_precision.training_side",
    "TrainingSide": "fx_precision.training_side",
    "build_training_side": "fx_precision.training_side",
    "contract_policy": "fx_precision.training_side",
    "token_logprobs": "fx_precision.logprobs",
    "row_plans": "fx_precision.contract.batch_rows",
    "EngineRows": "fx_precision.contract.batch_rows",
    "engine_rows": "fx_precision.contract.batch_rows",
    "RolloutConfig": "fx_precision.engines.adapter",
    "SamplingRequest": "fx_precision.engines.adapter",
    "EngineProcess": "fx_precision.engines.client",
    "engine_python": "fx_precision.engines.client",
    "full_bf16_weights": "fx_precision.onpolicy.weights",
    "tensors_digest": "fx_precision.checkpoints",
    "OnPolicyConfig": "fx_precision.onpolicy",
    "run_onpolicy": "fx_precision.onpolicy",
}
__all__ = sorted(_EXPORTS)
_CALLABLE_MODULES = ("census", "lint", "dump", "compare")  # a module named like its function, callable as it


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if name in _CALLABLE_MODULES else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fx_precision' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
