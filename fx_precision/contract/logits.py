"""The engine's logits processing after its output projection, and the op that computes it so.

vLLM's LogitsProcessor    logits = GEMM(h)                           (op class linears: fxp_engine.linear)
                          logits = tanh(logits / cap) * cap          soft cap (Gemma 2): the model's own ops, the same
                          logits *= scale                            scale (Granite: 1 / logits_scaling), in the
                                                                     logits' dtype: one rounding of x * scale
LogitsForm(scale, soft_cap)   what the rollout read off the engine (the contract's ``logits``)
fxp_engine.logits_scale       x * scale in x's dtype, as the engine's in-place multiply: a model's ``x / c`` rounds
                              x / c, which differs from x * (1 / c) in the last bit for most c; a custom op, so
                              Inductor cannot fuse the rounding away into the log-softmax that widens it again
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fx_precision.contract.op_context import OpContext
from fx_precision.errors import PrecisionError


@dataclass(frozen=True)
class LogitsForm:
    """What the engine does to its logits after the GEMM: ``scale`` (1.0: nothing) and ``soft_cap`` (None: none)."""

    scale: float = 1.0
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) or self.scale <= 0:
            raise PrecisionError(f"LogitsForm.scale={self.scale!r}: a finite positive number (the engine's logits scale)")
        object.__setattr__(self, "scale", float(self.scale))
        if self.soft_cap is not None:
            if isinstance(self.soft_cap, bool) or not isinstance(self.soft_cap, (int, float)) or not self.soft_cap > 0:
                raise PrecisionError(f"LogitsForm.soft_cap={self.soft_cap!r}: a positive number or null")
            object.__setattr__(self, "soft_cap", float(self.soft_cap))

    def describe(self) -> str:
        parts = ([f"soft cap {self.soft_cap:g}"] if self.soft_cap is not None else []) + (
            [f"x {self.scale!r} in the logits' dtype"] if self.scale != 1.0 else []
        )
        return ", then ".join(parts) or "as the GEMM gave them"

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "soft_cap": self.soft_cap}

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.logits") -> LogitsForm:
        if not isinstance(data, dict) or set(data) != {"scale", "soft_cap"}:
            raise PrecisionError(f"{where}: an object with scale and soft_cap, got {data!r}"[:300])
        try:
            return cls(**data)
        except PrecisionError as exc:
            raise PrecisionError(str(exc).replace("LogitsForm.", f"{where}.")) from None


@torch.library.custom_op("fxp_engine::logits_scale", mutates_args=())
def logits_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale`` in x's dtype: torch's eager multiply by a Python float (opmath fp32, one rounding), the engine's
    ``logits *= scale``."""
    return x * scale


@logits_scale.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.scale = inputs[1]


def _backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return grad * ctx.scale, None


logits_scale.register_autograd(_backward, setup_context=_setup)


__all__ = ["LogitsForm", "logits_scale"]
