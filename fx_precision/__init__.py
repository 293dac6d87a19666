"""fx_precision: declare, lower, see and enforce per-module mixed precision under FSDP2 and torch.compile.

master   (what the optimizer steps on)   fp32 master, refined per parameter
gather   (what a weight carries forward)  FSDP2 param_dtype, refined per module  -> PrecisionPlan units
compute  (what ops run at)                torch.autocast dtype (+ casts the backend inserts)
"""

from fx_precision.errors import PrecisionError
from fx_precision.plan import PrecisionPlan, UnitPlan, compile_precision
from fx_precision.spec import DEFAULT, ModuleSel, ParamSel, PrecisionSpec, Rule, parse_precision_rules

__all__ = [
    "DEFAULT",
    "ModuleSel",
    "ParamSel",
    "PrecisionError",
    "PrecisionPlan",
    "PrecisionSpec",
    "Rule",
    "UnitPlan",
    "compile_precision",
    "parse_precision_rules",
]
