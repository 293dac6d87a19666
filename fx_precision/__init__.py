"""fx_precision: declare, lower, see and enforce per-module mixed precision under FSDP2 and torch.compile.

master   (what the optimizer steps on)   fp32 master, refined per parameter
gather   (what a weight carries forward)  FSDP2 param_dtype, refined per module  -> PrecisionPlan units
compute  (what ops run at)                torch.autocast dtype (+ casts the backend inserts)

PrecisionSpec ─ compile_precision ─▶ PrecisionPlan ─ apply_fsdp2 ─▶ FSDP2 model ─ census
                                          └─ lint / torch.compile(backend=precision_backend)

The package is lazy (PEP 562): ``import fx_precision`` and ``import fx_precision.spec`` load
neither Dynamo nor FSDP2; a name is imported on first use. ``torch.compile(backend="fx_precision")``
finds the backend through the ``torch_dynamo_backends`` entry point.

Layout: the core (spec, plan, selection, unit_solver, lowering, policy, archs, fsdp, census,
lint, backend, passes) never imports ``fx_precision.tools`` (model zoos, bench, kernel census,
rank runner, sweep, CLI).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Any

_EXPORTS: dict[str, str] = {
    "DEFAULT": "fx_precision.spec",
    "ModuleSel": "fx_precision.spec",
    "ParamSel": "fx_precision.spec",
    "PrecisionSpec": "fx_precision.spec",
    "Rule": "fx_precision.spec",
    "parse_precision_rules": "fx_precision.spec",
    "PrecisionError": "fx_precision.errors",
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
    "Finding": "fx_precision.passes.findings",
    "PrecisionBackend": "fx_precision.backend",
    "dump": "fx_precision.dump",
    "DumpRecorder": "fx_precision.dump",
    "compare": "fx_precision.compare",
    "Comparison": "fx_precision.compare",
    "Side": "fx_precision.compare",
    "make_precision_backend": "fx_precision.backend",
    "eager_casts": "fx_precision.eager_fix",
    "EagerFix": "fx_precision.eager_fix",
    "EagerHook": "fx_precision.eager_fix",
    "precision_backend": "fx_precision.backend",
}
__all__ = sorted(_EXPORTS)

# tool modules that moved to fx_precision.tools: the old paths work for one release, with a warning
_MOVED = ("zoo", "toy_decoder", "arch_zoo", "bench", "kernel_census", "census_driver", "distributed", "sweep", "cli")


class _Package(types.ModuleType):
    """``census``, ``lint``, ``dump`` and ``compare`` are functions and submodules alike. Importing a
    submodule binds it on its package; here the function keeps the name (the module stays in
    ``sys.modules``, and ``from fx_precision.lint import LintReport`` works as ever)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _EXPORTS and _EXPORTS[name] == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fx_precision' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import fx_precision.zoo`` -> ``fx_precision.tools.zoo`` (the same module object), warning once."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        prefix, _, leaf = fullname.rpartition(".")
        if prefix == __name__ and leaf in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        leaf = spec.name.rpartition(".")[2]
        warnings.warn(
            f"fx_precision.{leaf} moved to fx_precision.tools.{leaf}; the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.import_module(f"{__name__}.tools.{leaf}")

    def exec_module(self, module: Any) -> None:
        """Nothing to run: ``create_module`` returned the already executed ``fx_precision.tools`` module."""


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())  # before editable-install finders that may still see an old file
