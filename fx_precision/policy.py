"""The run-level precision policy: three dtype axes plus the reduce dtype.

    PrecisionPolicy(master=fp32, gather=fp32, compute=bf16, reduce=fp32)
    ├── master   fp32   resident parameters; the optimizer steps on these (None: keep as loaded)
    ├── gather   fp32   FSDP2 param_dtype of every unit the spec does not refine
    ├── compute  bf16   torch.autocast dtype of the forward (None: no autocast)
    ├── reduce   fp32   FSDP2 reduce_dtype (gradient reduce-scatter)
    ├── spec            arch rules (from resolve_policy) followed by the user's rules
    ├── cast_forward_inputs = False   <- resolved: False exactly when compute is set
    └── contract        an EngineContract: the backend rewrites the graph to compute what the rollout
                        engine computes (gather and compute bf16)

``cast_forward_inputs=True`` makes every FSDP2 unit re-cast its float inputs to its gather dtype;
under autocast that silently upcasts the activation stream to fp32 at every unit boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from fx_precision.archs import arch_rules
from fx_precision.autocast import autocast_context
from fx_precision.contract import EngineContract
from fx_precision.dtypes import AXIS_DTYPES, COMPUTE_DTYPES, axis_dtype, dtype_name, optional_dtype, parse_dtype
from fx_precision.errors import PrecisionError
from fx_precision.lowering import compile_precision
from fx_precision.plan import PrecisionPlan
from fx_precision.spec import PrecisionSpec


@dataclass(frozen=True)
class PrecisionPolicy:
    master: torch.dtype | None = torch.float32
    gather: torch.dtype = torch.float32
    compute: torch.dtype | None = None
    reduce: torch.dtype = torch.float32
    spec: PrecisionSpec = field(default_factory=PrecisionSpec)
    cast_forward_inputs: bool | None = None
    contract: EngineContract | None = None  # compute what a rollout engine computes (the backend rewrites the graph)

    def __post_init__(self) -> None:
        for axis in ("master", "gather", "compute", "reduce"):
            value = getattr(self, axis)
            if value is None and axis in ("master", "compute"):
                continue
            allowed = COMPUTE_DTYPES if axis == "compute" else AXIS_DTYPES
            object.__setattr__(self, axis, axis_dtype(value, f"PrecisionPolicy.{axis}", allowed))
        if self.cast_forward_inputs is None:
            object.__setattr__(self, "cast_forward_inputs", self.compute is None)
        if self.contract is not None and not isinstance(self.contract, EngineContract):
            raise PrecisionError(
                f"PrecisionPolicy(contract={self.contract!r}): an fx_precision.contract.EngineContract (read it from an engine dump "
                "with fx_precision.contract.contract_of_dump), not a name or a dict"[:400]
            )
        if self.contract is not None and (self.compute != torch.bfloat16 or self.gather != torch.bfloat16):
            raise PrecisionError(
                f"PrecisionPolicy(contract=...): the engine runs bf16 weights and bf16 compute; this policy gathers at "
                f"{dtype_name(self.gather)} and computes at {dtype_name(self.compute) if self.compute else 'no autocast'}. "
                "Use gather=bf16, compute=bf16 (fp32 masters stay)"
            )

    def describe(self) -> str:
        return (
            f"master {dtype_name(self.master) if self.master else 'as loaded'}, gather {dtype_name(self.gather)}, "
            f"compute {dtype_name(self.compute) if self.compute else 'none (no autocast)'}, reduce {dtype_name(self.reduce)}, "
            f"cast_forward_inputs {self.cast_forward_inputs}, {len(self.spec)} rule(s)"
            + (f", engine contract ({self.contract.engine} {self.contract.version or ''})".replace(" )", ")") if self.contract else "")
        )

    def plan(self, model: nn.Module, wrap: Sequence[str] = ()) -> PrecisionPlan:
        """Compile this policy's spec onto ``model`` (gather default = ``gather``)."""
        return compile_precision(model, self.spec, default_gather=self.gather, default_master=self.master, wrap=wrap)

    def forward_context(self, device_type: str | torch.device = "cpu") -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` at the compute dtype on ``device_type`` (cpu / cuda), or a no-op."""
        return autocast_context(self.compute, device_type)


def _config_of(model_or_config: Any) -> Any:
    if isinstance(model_or_config, nn.Module):
        return getattr(model_or_config, "config", None)
    return model_or_config


def resolve_policy(
    model_or_config: Any,
    *,
    master: torch.dtype | str | None = torch.float32,
    gather: torch.dtype | str = torch.float32,
    compute: torch.dtype | str | None = None,
    reduce: torch.dtype | str = torch.float32,
    spec: PrecisionSpec | None = None,
    cast_forward_inputs: bool | None = None,
) -> PrecisionPolicy:
    """A ``PrecisionPolicy`` with the per-architecture rules placed before the user's ``spec``.

    The user's rules come last, so they win (last match wins). With no compute dtype the
    architecture registry contributes nothing and ``cast_forward_inputs`` resolves to True: the
    result wraps exactly like a plain per-layer FSDP2 wrap.
    """
    base = PrecisionPolicy(
        master=optional_dtype(master, what="master"),
        gather=parse_dtype(gather, what="gather"),
        compute=optional_dtype(compute, what="compute"),
        reduce=parse_dtype(reduce, what="reduce"),
        spec=PrecisionSpec(),
        cast_forward_inputs=cast_forward_inputs,
    )
    model = model_or_config if isinstance(model_or_config, nn.Module) else None
    return replace(base, spec=arch_rules(_config_of(model_or_config), base, model) + (spec or PrecisionSpec()))
