"""Math the engine runs as torch's eager kernels: fxp_engine::eager_math (a reduction, mean or sum, or a
transcendental: exp, cos, sin, silu, ...; Inductor would sum and approximate otherwise) and fxp_engine::eager_layer_norm
(torch's layer-norm kernel, forward and backward); backward in plain torch ops, traced into the backward graph."""

from __future__ import annotations

import functools
from typing import Any

import torch

from fx_precision.contract.op_context import OpContext

_UNARY: dict[str, Any] = {
    "exp": torch.exp,
    "log": torch.log,
    "cos": torch.cos,
    "sin": torch.sin,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "rsqrt": torch.rsqrt,
    "erf": torch.erf,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
}
EAGER_MATH = frozenset({*_UNARY, "mean", "sum", "pow"})


def _eager(x: torch.Tensor, op: str, dims: list[int], keepdim: bool, exponent: float) -> torch.Tensor:
    if op == "mean":
        return x.mean(dims, keepdim=keepdim) if dims else x.mean()
    if op == "sum":
        return x.sum(dims, keepdim=keepdim) if dims else x.sum()
    if op == "pow":
        return x.pow(exponent)
    return _UNARY[op](x)


@torch.library.custom_op("fxp_engine::eager_math", mutates_args=())
def eager_math(x: torch.Tensor, op: str, dims: list[int], keepdim: bool, exponent: float) -> torch.Tensor:
    """``op`` by torch's eager kernel. The engine computes its norms' mean of squares, its rotary tables
    and its activations with these; Inductor's generated code sums in another order and uses other
    exp / cos / sin approximations (one fp32 ulp apart on ~10-30% of values, enough to flip a bf16
    rounding now and then), so a compiled graph keeps the eager kernel here."""
    return _eager(x, op, dims, keepdim, exponent).clone(memory_format=torch.contiguous_format)  # fresh, in the fake's layout


@eager_math.register_fake
def _(x, op, dims, keepdim, exponent):
    shaped = _eager(torch.empty_like(x, device="meta"), op, dims, keepdim, exponent)
    return torch.empty(shaped.shape, dtype=shaped.dtype, device=x.device)


def _expand_reduced(grad: torch.Tensor, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    if dims and not keepdim:
        for d in sorted(d % x.dim() for d in dims):
            grad = grad.unsqueeze(d)
    return grad.expand(x.shape)


def eager_math_gradient(x: torch.Tensor, grad: torch.Tensor, op: str, dims: list[int], keepdim: bool, exponent: float) -> torch.Tensor:
    """The gradient of ``eager_math`` at ``x``, in plain torch ops: AOTAutograd traces them into the backward
    graph and Inductor fuses them there (only the forward has to be the engine's arithmetic)."""
    if op in ("mean", "sum"):
        wide = _expand_reduced(grad, x, dims, keepdim)
        if op == "mean":
            wide = wide / (x.numel() // max(1, grad.numel()))
        return wide.to(x.dtype)
    if op in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh" if op == "gelu_tanh" else "none")
    if op == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    derivative = {
        "exp": lambda: x.exp(),
        "log": lambda: x.reciprocal(),
        "cos": lambda: -x.sin(),
        "sin": lambda: x.cos(),
        "tanh": lambda: 1 - x.tanh() ** 2,
        "sigmoid": lambda: x.sigmoid() * (1 - x.sigmoid()),
        "rsqrt": lambda: -0.5 * x.rsqrt() ** 3,
        "erf": lambda: (2 / torch.pi**0.5) * torch.exp(-x * x),
        "pow": lambda: exponent * x.pow(exponent - 1),
    }[op]
    return (grad * derivative()).to(x.dtype)


def _eager_math_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.args = inputs[1:]


def _eager_math_grad(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (x,) = ctx.saved_tensors
    return eager_math_gradient(x, grad, *ctx.args), None, None, None, None


eager_math.register_autograd(_eager_math_grad, setup_context=_eager_math_setup)


@torch.library.custom_op("fxp_engine::eager_layer_norm", mutates_args=())
def eager_layer_norm(x: torch.Tensor, shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` by torch's eager kernel (its mean and variance in its order; Inductor's ``var_mean``
    sums in another)."""
    return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)


@eager_layer_norm.register_fake
def _(x, shape, weight, bias, eps):
    return torch.empty_like(x)


@torch.library.custom_op("fxp_engine::eager_layer_norm_backward", mutates_args=())
def eager_layer_norm_backward(
    x: torch.Tensor, grad: torch.Tensor, shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> list[torch.Tensor]:
    """Gradients of ``eager_layer_norm`` for (x, weight, bias) by torch's layer-norm backward kernel (absent
    parts as empty tensors)."""
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
    mask = [True, weight is not None, bias is not None]
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias, mask)
    return [gx, gw if gw is not None else x.new_empty(0), gb if gb is not None else x.new_empty(0)]


@eager_layer_norm_backward.register_fake
def _(x, grad, shape, weight, bias, eps):
    return [torch.empty_like(t) if t is not None else x.new_empty(0) for t in (x, weight, bias)]


def _layer_norm_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, shape, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.shape, ctx.eps, ctx.present = shape, eps, (weight is not None, bias is not None)


def _layer_norm_grad(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias = ctx.saved_tensors
    gx, gw, gb = torch.ops.fxp_engine.eager_layer_norm_backward(x, grad.contiguous(), ctx.shape, weight, bias, ctx.eps)
    return gx, None, gw if ctx.present[0] else None, gb if ctx.present[1] else None, None


eager_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)
