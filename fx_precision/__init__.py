"""fx_precision: declare, lower, see and enforce per-module mixed precision under FSDP2 and torch.compile.

master   (what the optimizer steps on)   fp32 master, refined per parameter
gather   (what a weight carries forward)  FSDP2 param_dtype, refined per module  -> PrecisionPlan units
compute  (what ops run at)                torch.autocast dtype (+ casts the backend inserts)

PrecisionSpec ─ compile_precision ─▶ PrecisionPlan ─ apply_fsdp2 ─▶ FSDP2 model ─ census
                                          └─ lint / torch.compile(backend=precision_backend)
"""

from fx_precision.backend import PrecisionBackend, make_precision_backend, precision_backend
from fx_precision.census import Census, CensusRecorder, census
from fx_precision.errors import PrecisionError
from fx_precision.fsdp import apply_fsdp2
from fx_precision.lint import LintReport, lint
from fx_precision.passes.findings import Finding
from fx_precision.plan import PrecisionPlan, UnitPlan, compile_precision
from fx_precision.policy import PrecisionPolicy, resolve_policy
from fx_precision.spec import DEFAULT, ModuleSel, ParamSel, PrecisionSpec, Rule, parse_precision_rules

__all__ = [
    "DEFAULT",
    "Census",
    "CensusRecorder",
    "Finding",
    "LintReport",
    "ModuleSel",
    "ParamSel",
    "PrecisionBackend",
    "PrecisionError",
    "PrecisionPlan",
    "PrecisionPolicy",
    "PrecisionSpec",
    "Rule",
    "UnitPlan",
    "apply_fsdp2",
    "census",
    "compile_precision",
    "lint",
    "make_precision_backend",
    "parse_precision_rules",
    "precision_backend",
    "resolve_policy",
]
