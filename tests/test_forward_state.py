"""The contract's ops that read or write state beyond their tensors say so, and a recompute gives their bits.

declared      every op that reads the forward's plan or sums, the bound norm orders or the route sink is an
              ordered effect (contract/ops/forward_state.py); the ops of pure arithmetic are not
recomputed    each such op under torch.compile (Inductor), forward and backward inside engine_rows: run plain,
              with activation checkpointing around the compiled function (the forward runs again in backward)
              and with checkpointing inside it (the partitioner's recompute): the same outputs and gradients,
              bit for bit; the residual sum handed across a graph break included; routes recorded once
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
import torch._dynamo
from torch._higher_order_ops.effects import _get_effect
from torch._library.effects import EffectType
from torch.utils.checkpoint import checkpoint

from fx_precision.contract.batch_rows import EngineRows, engine_rows
from fx_precision.contract.gdn import engine_gated_rms_norm, engine_gdn
from fx_precision.contract.inductor_norms import NormReduction, register_norm_orders
from fx_precision.contract.linear_order import LinearOrders, candidate_orders
from fx_precision.contract.logits import logits_scale
from fx_precision.contract.moe import fused_moe, moe_route, record_routes, reset_route_sink, route_sink
from fx_precision.contract.ops import (
    eager_math,
    engine_attention,
    engine_linear,
    engine_rotary,
    inductor_stream,
    inductor_sum_squares,
    residual_add,
    stored,
    unrounded_residual,
)
from tests.test_engine_contract import VEC
from tests.test_gdn_contract import _layer_inputs, _plan

BF16 = torch.bfloat16
STATEFUL = (engine_linear, engine_attention, residual_add, unrounded_residual, engine_gdn, record_routes, inductor_sum_squares,
            inductor_stream)  # fmt: skip
PURE = (engine_rotary, stored, eager_math, moe_route, fused_moe, engine_gated_rms_norm, logits_scale)


def test_every_op_that_reads_or_writes_state_declares_it_and_no_other_does() -> None:
    """An ordered effect is what the compiler keeps in order, never drops and never recomputes in its partition."""
    for op in STATEFUL:
        assert _get_effect(op._opoverload) is EffectType.ORDERED, op._qualname
    for op in PURE:
        assert _get_effect(op._opoverload) is None, op._qualname


def _runs(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], state: Callable[[], AbstractContextManager[object]],
          modes: tuple[str, ...] = ("plain", "around", "inside")) -> dict[str, tuple[torch.Tensor, list[torch.Tensor | None]]]:  # fmt: skip
    """``fn`` compiled by Inductor, run plain, checkpointed around and checkpointed inside, forward and backward within
    ``state()``: each run's output and its inputs' gradients."""

    def inside(*xs: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, *xs, use_reentrant=False)

    runs: dict[str, tuple[torch.Tensor, list[torch.Tensor | None]]] = {}
    for name in modes:
        torch._dynamo.reset()
        compiled = torch.compile(inside if name == "inside" else fn, backend="inductor", dynamic=False)
        xs = tuple(x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs)
        with state():
            out = checkpoint(compiled, *xs, use_reentrant=False) if name == "around" else compiled(*xs)
            out.float().square().sum().backward()
        runs[name] = (out.detach(), [x.grad for x in xs])
    return runs


def _same_bits(runs: dict[str, tuple[torch.Tensor, list[torch.Tensor | None]]]) -> None:
    out, grads = runs["plain"]
    assert any(g is not None and g.abs().sum() > 0 for g in grads), "the op's backward reached no input"
    for name in sorted(set(runs) - {"plain"}):
        other, other_grads = runs[name]
        assert torch.equal(out, other), name
        for i, (g, h) in enumerate(zip(grads, other_grads, strict=True)):
            assert (g is None and h is None) or (g is not None and h is not None and torch.equal(g, h)), f"{name}: input {i}"


def _rows(shape: tuple[int, int], orders: LinearOrders, **plans: torch.Tensor) -> Callable[[], AbstractContextManager[object]]:
    rows = torch.full(shape, shape[1], dtype=torch.int32)
    return lambda: engine_rows(EngineRows(rows, rows, orders, **plans))


def test_the_engine_linear_recomputed_reads_the_same_row_plan() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 12, 96, generator=g).to(BF16), (torch.randn(64, 96, generator=g) * 0.1).to(BF16)
    orders = LinearOrders.uniform([(64, 96)], [12], lambda k: candidate_orders(k, 1)[0])
    _same_bits(_runs(lambda x, w: engine_linear(x, w, None, False, 0, "proj"), (x, w), _rows((1, 12), orders)))


def test_the_engine_attention_recomputed_gives_the_same_bits() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 17, h, 32, generator=g).to(BF16) for h in (4, 2, 2))
    lens = torch.full((2,), 17)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return engine_attention(q, k, v, lens, None, 32**-0.5, True, -1, 0, **VEC.op_args())

    _same_bits(_runs(attend, (q, k, v), _rows((2, 17), LinearOrders(1))))


def test_the_residual_sum_handed_across_a_graph_break_survives_a_recompute() -> None:
    """residual_add in one graph, the norm of its fp32 sum in the next (unrounded_residual): checkpointed, the
    recompute keeps a sum of its own and the norm reads it: the same bits as the run that kept one."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(1, 9, 64, generator=g).to(BF16), torch.randn(1, 9, 64, generator=g).to(BF16)

    def add_then_norm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = residual_add(a, b)
        torch._dynamo.graph_break()  # an FSDP2 unit's edge: the sum leaves one graph, its norm is in the next
        h = unrounded_residual(s)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)

    # around only: a graph break inside a checkpoint makes Dynamo run the whole block eagerly (no graph of ours)
    runs = _runs(add_then_norm, (a, b), _rows((1, 9), LinearOrders(1)), modes=("plain", "around"))
    _same_bits(runs)
    exact = a.float() + b.float()  # the norm read the fp32 sum, not its rounding
    assert torch.equal(runs["plain"][0], (exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16))


def test_the_delta_rule_recomputed_reads_the_same_pieces() -> None:
    x, weight, a, b, A_log, dt_bias = _layer_inputs(20, 2, 4, 64, 4, seed=3)
    plan = _plan(("prefill", 15), ("decode", 5))

    def delta_rule(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return engine_gdn(x, weight, a, b, A_log, dt_bias, 2, False, 1e-5, "portable", "layer.0")

    _same_bits(_runs(delta_rule, (x, weight, a, b, A_log, dt_bias), _rows((1, 20), LinearOrders(1), gdn=plan)))


def test_the_router_recomputed_routes_alike_and_records_its_routes_once() -> None:
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(4)).to(BF16)
    sinks: list[list[torch.Tensor]] = []

    @contextmanager
    def tapped() -> Iterator[None]:
        sinks.append([])
        token = route_sink(sinks[-1])
        try:
            yield
        finally:
            reset_route_sink(token)

    def route(logits: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route(logits, 3, True)
        record_routes(ids)  # as the rewrite records them
        return weights

    _same_bits(_runs(route, (logits,), tapped))
    assert [len(s) for s in sinks] == [1, 1, 1]  # plain, around, inside: a recompute in backward records nothing
    assert all(torch.equal(s[0], sinks[0][0]) for s in sinks)


def test_a_norms_engine_order_recomputed_is_found_by_its_weight_again() -> None:
    norms = torch.nn.Module()
    norms.norm = torch.nn.Module()
    norms.norm.weight = torch.nn.Parameter(torch.ones(96))
    register_norm_orders(norms, (NormReduction(32, 16, 96, "norm"),))
    x = torch.randn(1, 7, 96, generator=torch.Generator().manual_seed(5))

    def sum_squares(x: torch.Tensor) -> torch.Tensor:
        return inductor_sum_squares(x, norms.norm.weight)

    _same_bits(_runs(sum_squares, (x,), lambda: _rows((1, 7), LinearOrders(1))()))


def test_a_norms_stored_rounding_recomputed_is_found_by_its_weight_again() -> None:
    """The stream as the engine's norm kernel leaves it (rounded through bf16 where it stores it): a recompute under
    checkpointing rounds again, the same bits, and the gradient passes straight through."""
    norms = torch.nn.Module()
    norms.norm = torch.nn.Module()
    norms.norm.weight = torch.nn.Parameter(torch.ones(96))
    register_norm_orders(norms, (NormReduction(32, 16, 96, "norm", "bfloat16"),))
    x = torch.randn(1, 7, 96, generator=torch.Generator().manual_seed(6))

    def stream(x: torch.Tensor) -> torch.Tensor:
        return inductor_stream(x * 3, norms.norm.weight) * 2

    runs = _runs(stream, (x,), lambda: _rows((1, 7), LinearOrders(1))())
    _same_bits(runs)
    out, (grad, *_) = runs["plain"]
    assert torch.equal(out, (x * 3).to(BF16).float() * 2) and not torch.equal(out, x * 6)
    assert grad is not None and torch.allclose(grad, 12 * out, rtol=1e-6, atol=0)  # d sum(out ** 2): 2 * out * 2 * 3, straight through


OUTSIDE = {  # the ops whose state is the forward's own: outside engine_rows there is none to read
    "linear": lambda: engine_linear(torch.ones(1, 4, 32, dtype=BF16), torch.ones(8, 32, dtype=BF16), None, False, 0, "proj"),
    "residual_add": lambda: residual_add(torch.ones(1, 4, 32, dtype=BF16), torch.ones(1, 4, 32, dtype=BF16)),
    "unrounded_residual": lambda: unrounded_residual(torch.ones(1, 4, 32, dtype=BF16)),
    "gdn": lambda: engine_gdn(*_layer_inputs(4, 2, 4, 64, 4, seed=0), 2, False, 1e-5, "portable", "layer.0"),
}


@pytest.mark.parametrize("op", sorted(OUTSIDE))
def test_an_op_with_the_forwards_state_refuses_outside_the_forward_that_holds_it(op: str) -> None:
    """Outside engine_rows (a recompute in a backward run after the forward's block closed): one line, never a guess.
    (Attention reads the forward's KV tiles only where its plan has them; the router's sink is optional; the norm
    orders are bound to modules, not opened per forward.)"""
    with pytest.raises(Exception, match=r"ran outside fx_precision\.contract\.batch_rows\.engine_rows"):
        OUTSIDE[op]()
