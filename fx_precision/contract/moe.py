"""Mixture of experts under the contract: the engine's router and fused experts, as ops a training graph can call.

    MoeKernel                 what the probe read off the engine (engines/vllm/session.py, ``_moe``): the experts kernel
                              (vLLM's CPU fused experts, its portable "vec" path), the activation, the router's
                              renormalisation, the expert count and experts per token
    engine_route(logits, k, renormalize)        vLLM's CPU router (``_softmax_topk``) as it runs: torch.topk of the bf16
                              logits (``sorted=False``: the slots come in the order the engine's top-k leaves them), then
                              softmax over the k logits (renormalise) or exp(logit - logsumexp(logits)), in bf16, as fp32
    fxp_engine::moe_route(logits, k, renormalize) -> (weights fp32, ids int64)
        forward   engine_route, eagerly (an extern kernel for Inductor: the top-k's slot order and the bf16
                  softmax stay the engine's)
        backward  the router's derivative in fp32, written out (moe_route_backward): softmax's over the chosen logits, or
                  exp(logit - logsumexp)'s over all of them
    fxp_engine::fused_moe(x, w13, w2, weights, ids, exp, store, combine) -> bf16
        forward   moe_kernels.cpp ``fxp_fused_moe``: per token and slot the gate and up FMA chains over H, SiLU(gate)
                  * up with the build's exp stored to bf16, the down chain over I, and the slots combined in top-k
                  order (y0 * w0, then FMAs or multiply-adds), stored once (nearest even, or truncated)
        backward  the experts recomputed, their derivatives written out per expert (fused_moe_backward): of x, w13, w2
                  and the weights, the GEMMs in the operands' dtype as the model's own autograd runs them, the rest in
                  fp32 (ops of their own: AOTAutograd traces backwards with fake tensors)

The training side's routes under the contract are the op's (``route_sink``: routes.RouteTap reads them).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch

from fx_precision.contract.op_context import OpContext
from fx_precision.contract.ops.forward_state import declare_forward_state
from fx_precision.contract.vocabulary import MOE_COMBINES as COMBINES
from fx_precision.contract.vocabulary import MOE_EXPS as EXPS
from fx_precision.contract.vocabulary import MOE_STORES as STORES
from fx_precision.errors import PrecisionError

KERNELS = ("vec",)  # vLLM's portable CPU fused experts; its AMX kernel ("amx") sums in other blocks: not followed
ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class MoeKernel:
    """The engine's mixture-of-experts arithmetic (module docstring); ``exp``, ``store``, ``combine``: the form of the
    kernel build the engine loaded, as the probe told them apart (vLLM's _C: fast512, nearest-even, fma; _C_AVX512:
    fast512, truncate, fma; _C_AVX2: sleef, truncate, mul+add)."""

    kernel: str = "vec"
    activation: str = "silu"
    renormalize: bool = True
    experts: int = 1
    top_k: int = 1
    details: dict[str, Any] = field(default_factory=dict, compare=False)  # what the probe compared
    exp: str = "fast512"
    store: str = "nearest-even"
    combine: str = "fma"

    def __post_init__(self) -> None:
        for name, allowed in (("kernel", KERNELS), ("activation", ACTIVATIONS), ("exp", EXPS), ("store", STORES), ("combine", COMBINES)):
            if getattr(self, name) not in allowed:
                raise PrecisionError(f"MoeKernel.{name}={getattr(self, name)!r}: one of {', '.join(allowed)}")
        if not isinstance(self.renormalize, bool):
            raise PrecisionError(f"MoeKernel.renormalize={self.renormalize!r}: true or false")
        for name in ("experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PrecisionError(f"MoeKernel.{name}={value!r}: a positive integer")
        if self.top_k > self.experts:
            raise PrecisionError(f"MoeKernel: top_k {self.top_k} > experts {self.experts}")

    def describe(self) -> str:
        norm = "renormalised" if self.renormalize else "exp(logit - logsumexp)"
        form = f"{self.exp} exp, {self.store} store, {self.combine} combine"
        return f"{self.top_k} of {self.experts}, top-k of the bf16 logits, {norm}; {self.kernel} fused experts ({form}), {self.activation}"

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "activation": self.activation, "renormalize": self.renormalize, "experts": self.experts,
                "top_k": self.top_k, "exp": self.exp, "store": self.store, "combine": self.combine,
                "details": dict(self.details)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object) -> MoeKernel:
        names = ("kernel", "activation", "renormalize", "experts", "top_k", "details")
        forms = ("exp", "store", "combine")  # a dump written before the probe told the builds apart: the _C form
        if not isinstance(data, dict) or not set(names) <= set(data) or not set(data) <= set(names + forms):
            raise PrecisionError(f"contract.moe: a JSON object of {', '.join(names + forms)}, got {data!r}"[:300])
        if not isinstance(data["details"], dict):
            raise PrecisionError("contract.moe.details: a JSON object")
        return cls(**{n: data[n] for n in names + forms if n in data})


def engine_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU router on ``logits`` [T, E] (module docstring): (weights fp32 [T, k], expert ids int64 [T, k])."""
    values, ids = torch.topk(logits, k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = torch.softmax(values, dim=-1)
    else:
        weights = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    return weights.to(torch.float32), ids.to(torch.int64)


_SINK: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("fxp_route_sink", default=None)


def route_sink(sink: list[torch.Tensor] | None) -> contextvars.Token[list[torch.Tensor] | None]:
    """Every ``record_routes`` call (one after each ``moe_route`` of the rewrite) appends its expert ids to ``sink``
    until the token is reset (routes.RouteTap)."""
    return _SINK.set(sink)


def reset_route_sink(token: contextvars.Token[list[torch.Tensor] | None]) -> None:
    _SINK.reset(token)


@torch.library.custom_op("fxp_engine::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dtype != torch.bfloat16 or logits.dim() != 2:
        raise PrecisionError(f"engine router: bf16 logits [tokens, experts], got {logits.dtype} {tuple(logits.shape)}")
    weights, ids = engine_route(logits.cpu(), top_k, renormalize)
    return weights.to(logits.device), ids.to(logits.device)


@moe_route.register_fake
def _(logits, top_k, renormalize):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


def _route_setup(ctx: OpContext, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    logits, _top_k, renormalize = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.renormalize = renormalize


@torch.library.custom_op("fxp_engine::moe_route_backward", mutates_args=())
def moe_route_backward(grad_weights: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The router's derivative in fp32, written out (an op of its own: AOTAutograd traces a backward with fake tensors)."""
    x, g = logits.float(), grad_weights.float()
    chosen = x.gather(-1, ids)
    grad = torch.zeros_like(x)
    if renormalize:  # w = softmax(chosen)
        w = torch.softmax(chosen, dim=-1)
        grad.scatter_add_(-1, ids, w * (g - (g * w).sum(-1, keepdim=True)))
    else:  # w = exp(chosen - logsumexp(x))
        w = (chosen - torch.logsumexp(x, dim=-1, keepdim=True)).exp()
        grad -= torch.softmax(x, dim=-1) * (g * w).sum(-1, keepdim=True)
        grad.scatter_add_(-1, ids, g * w)
    return grad.to(logits.dtype)


@moe_route_backward.register_fake
def _(grad_weights, logits, ids, renormalize):
    return torch.empty_like(logits)


def _route_backward(ctx: OpContext, grad_weights: torch.Tensor, _grad_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    logits, ids = ctx.saved_tensors
    return moe_route_backward(grad_weights, logits, ids, ctx.renormalize), None, None


moe_route.register_autograd(_route_backward, setup_context=_route_setup)


@torch.library.custom_op("fxp_engine::record_routes", mutates_args=())
def record_routes(ids: torch.Tensor) -> None:
    """The expert ids a router op chose, appended to the route sink where one is open (``route_sink``): the forward's
    routes for RouteTap. A recompute in backward (activation checkpointing) records nothing: each route once."""
    sink = _SINK.get()
    if sink is not None and torch._C._current_graph_task_id() == -1:  # -1: not inside autograd's backward
        sink.append(ids.detach().clone())


@record_routes.register_fake
def _(ids):
    return None


declare_forward_state(record_routes)  # its only result is the sink's entry: an effect, never dropped, in order


@torch.library.custom_op("fxp_engine::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, exp: str = "fast512",
              store: str = "nearest-even", combine: str = "fma") -> torch.Tensor:  # fmt: skip
    from fx_precision.contract.kernels import engine_kernels

    return engine_kernels().fused_moe(x, w13, w2, weights, ids, exp, store, combine).to(x.device)


@fused_moe.register_fake
def _(x, w13, w2, weights, ids, exp="fast512", store="nearest-even", combine="fma"):
    return x.new_empty(x.shape, dtype=torch.bfloat16)


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The same experts in plain fp32 torch math, differentiable: sum_j w_j * down(SiLU(gate) * up) (the reference the
    tests hold the kernel and the written-out derivatives of fused_moe_backward to)."""
    tokens, k = ids.shape
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    for e in flat.unique().tolist():
        picked = (flat == e).nonzero().squeeze(1)
        rows = token_of[picked]
        gate, up = (x[rows].float() @ w13[e].float().t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].float().t()
        out = out.index_add(0, rows, y * weights.reshape(-1)[picked].float().unsqueeze(1))
    return out


def _moe_setup(ctx: OpContext, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])  # the tensors; the form's strings change the forward's roundings, not its derivative


@torch.library.custom_op("fxp_engine::fused_moe_backward", mutates_args=())
def fused_moe_backward(grad: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The experts' derivatives written out per expert (an op of its own: the routes decide its shapes). The GEMMs run
    in the operands' dtype, as the model's own autograd runs them (bf16 in training; fp32 operands give fp32 math), the
    activation's derivative, a token's sum over its experts and the route weights' derivative in fp32."""
    tokens, k = ids.shape
    dtype = torch.promote_types(x.dtype, torch.promote_types(w13.dtype, w2.dtype))
    g_out = grad.float()
    gx, gw = torch.zeros(x.shape), torch.zeros(tokens, k)
    g13, g2 = torch.zeros_like(w13), torch.zeros_like(w2)
    flat = ids.reshape(-1)
    token_of = torch.arange(tokens).repeat_interleave(k)
    for e in flat.unique().tolist():
        picked = (flat == e).nonzero().squeeze(1)
        rows = token_of[picked]
        xe, a13, a2 = x[rows].to(dtype), w13[e].to(dtype), w2[e].to(dtype)
        gate, up = (xe @ a13.t()).float().chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        act = (gate * s * up).to(dtype)
        go = g_out[rows]
        gw.view(-1).index_add_(0, picked, (go * (act @ a2.t()).float()).sum(-1))
        dy = (go * weights.reshape(-1)[picked].float().unsqueeze(1)).to(dtype)
        g2[e] = dy.t() @ act
        dact = (dy @ a2).float()
        dh = torch.cat([dact * up * (s + gate * s * (1 - s)), dact * gate * s], dim=-1).to(dtype)
        g13[e] = dh.t() @ xe
        gx.index_add_(0, rows, (dh @ a13).float())
    return gx.to(x.dtype), g13, g2, gw.to(weights.dtype)


@fused_moe_backward.register_fake
def _(grad, x, w13, w2, weights, ids):
    return torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2), torch.empty_like(weights)


def _moe_backward(ctx: OpContext, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w13, w2, weights, ids = ctx.saved_tensors
    return (*fused_moe_backward(grad, x, w13, w2, weights, ids), None, None, None, None)


fused_moe.register_autograd(_moe_backward, setup_context=_moe_setup)
