"""Mixture of experts under the engine contract (contract/moe.py, passes/rewrites/engine/moe.py).

the ops          the router is torch's top-k (sorted=False) of the bf16 logits and a bf16 softmax over them (or
                 exp(logit - logsumexp)); the fused experts give the same bits on 1 and 2 threads, stay within
                 bf16 rounding of plain fp32 experts math, and refuse ids outside the experts
the rewrite      a transformers Qwen3-MoE compiled under a contract with an MoE kernel computes every MoE block
                 with fxp_engine.moe_route and fxp_engine.fused_moe (no top-k, no grouped GEMM left), its router and
                 experts get gradients, and the routes it takes are reported; a contract whose probe read no MoE
                 kernel refuses the graph with the reason; a router with a score bias (DeepSeek-V3's) is refused
the tap          entered around a compiled forward, the routes tap leaves the precision pass's casts as they are
                 (its frames are not taken for the program's)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fx_precision as fxp
from fx_precision.contract import AttentionArithmetic, EngineContract
from fx_precision.contract.batch_rows import EngineRows, engine_rows
from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.linear_order import LinearOrders, candidate_orders
from fx_precision.contract.moe import MoeKernel, engine_route, experts_reference, fused_moe, moe_route
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
VEC = AttentionArithmetic(scores="vec", exp="libm", reduce="avx2", p_bf16=False, fma=False, store="truncate")


def _experts(tokens: int, hidden: int, inter: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).to(BF16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(BF16)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.05).to(BF16)
    weights, ids = engine_route(torch.randn(tokens, experts, generator=g).to(BF16), k, True)
    return x, w13, w2, weights, ids


def test_the_router_is_the_engines_top_k_and_bf16_softmax() -> None:
    logits = (torch.randint(-3, 4, (40, 16)) / 4).to(BF16)  # many ties
    weights, ids = engine_route(logits, 4, True)
    values, want = torch.topk(logits, 4, dim=-1, sorted=False)
    assert torch.equal(ids, want) and weights.dtype == torch.float32
    assert torch.equal(weights, torch.softmax(values, dim=-1).float())
    unnormed, _ = engine_route(logits, 4, False)
    assert torch.equal(unnormed, (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp().float())


def test_the_fused_experts_give_the_same_bits_on_any_thread_count_and_are_the_experts() -> None:
    x, w13, w2, weights, ids = _experts(45, 128, 96, 10, 3, seed=1)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(engine_kernels().fused_moe(x, w13, w2, weights, ids))
    torch.set_num_threads(1)
    assert outs[0].dtype == BF16 and torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    reference = experts_reference(x, w13, w2, weights, ids)
    assert torch.allclose(outs[0].float(), reference, rtol=2e-2, atol=2e-3)
    with pytest.raises(PrecisionError, match=r"expert ids must lie in \[0, 10\)"):
        engine_kernels().fused_moe(x, w13, w2, weights, ids + 8)


def _sequential(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ w [N, H].T as one fp32 chain per output in H order (bf16 products are exact in fp32: an FMA chain)."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + x[:, k : k + 1].float() * w[:, k].float()
    return acc


def _truncated(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)


@pytest.mark.skipif(engine_kernels().sleef_expf8 is None, reason="this torch exports no Sleef_expf8_u10 (not an x86 build)")
def test_the_avx2_builds_form_is_sleefs_exp_truncated_stores_and_multiply_adds() -> None:
    """vLLM's _C_AVX2 experts: SiLU through SLEEF's expf (torch.exp's own on x86), 1 / (1 + e), stores truncated, the slots
    summed as y * w then +. Each expert's down projection is the identity, so the output is the slots' activations
    weighted: every bit is checked against torch arithmetic in that order."""
    g = torch.Generator().manual_seed(3)
    tokens, hidden, k = 512, 32, 3
    x = torch.randn(tokens, hidden, generator=g).to(BF16)
    w13 = (torch.randn(k, 2 * hidden, hidden, generator=g) * 0.75).to(BF16)
    w2 = torch.eye(hidden, dtype=BF16).expand(k, hidden, hidden).contiguous()
    ids = torch.arange(k).repeat(tokens, 1)
    weights = torch.rand(tokens, k, generator=g).to(BF16).float()
    acts = []
    for e in range(k):
        gate, up = _sequential(x, w13[e]).chunk(2, dim=-1)
        acts.append(_truncated(((1 / (1 + torch.exp(-gate))) * gate) * up))
    want = acts[0] * weights[:, :1]
    for j in range(1, k):
        want = want + acts[j] * weights[:, j : j + 1]
    got = engine_kernels().fused_moe(x, w13, w2, weights, ids, exp="sleef", store="truncate", combine="mul+add")
    assert torch.equal(got.float(), _truncated(want))
    rounded = engine_kernels().fused_moe(x, w13, w2, weights, ids)  # the _C build's form: nearest-even stores, FMAs
    assert not torch.equal(rounded, got)
    with pytest.raises(PrecisionError, match=r"store='half-up', one of nearest-even, truncate"):
        engine_kernels().fused_moe(x, w13, w2, weights, ids, store="half-up")


def test_the_ops_differentiate_as_plain_experts_math() -> None:
    x, w13, w2, _, _ = _experts(12, 64, 32, 6, 2, seed=2)
    logits = torch.randn(12, 6).to(BF16).requires_grad_(True)
    x, w13, w2 = (t.clone().requires_grad_(True) for t in (x, w13, w2))
    weights, ids = moe_route(logits, 2, True)
    fused_moe(x, w13, w2, weights, ids).float().square().sum().backward()
    for t in (logits, x, w13, w2):
        assert t.grad is not None and t.grad.dtype == BF16 and torch.isfinite(t.grad.float()).all() and t.grad.abs().sum() > 0


def _moe_model(train: bool = False) -> tuple[Any, torch.Tensor, LinearOrders]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fx_precision.contract.linear_order import engine_linear_shapes

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=10,
                            num_experts_per_tok=3, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).train(train)
    model.set_experts_implementation("batched_mm")  # as the training side under a contract with experts (training_side._build)
    ids = torch.randint(0, 256, (1, 12))
    shapes = engine_linear_shapes(model, input_ids=ids[:, :4]) | {(10, 128)}  # the routers' F.linear (not an nn.Linear)
    orders = LinearOrders.uniform(shapes, [12], lambda k: candidate_orders(k, 1)[0])
    return model, ids, orders


def _compiled(model: Any, contract: EngineContract) -> tuple[Any, Any, Any]:
    from fx_precision.backend import make_precision_backend

    policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False, contract=contract)
    backend = make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager")
    return torch.compile(model, backend=backend), policy, backend


def _refused(model: Any, ids: torch.Tensor, orders: LinearOrders, contract: EngineContract, pattern: str) -> None:
    """A forward of ``model`` compiled under ``contract`` is refused with ``pattern`` in its error."""
    compiled, policy, _ = _compiled(model, contract)
    rows = torch.full(tuple(ids.shape), ids.shape[1], dtype=torch.int32)
    with pytest.raises(Exception, match=pattern):
        with torch.no_grad(), policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
            compiled(input_ids=ids, use_cache=False)


@pytest.mark.needs_transformers
def test_an_moe_decoder_runs_the_engines_router_and_experts_and_trains() -> None:
    from fx_precision.routes import MoeSpec, RouteTap

    model, ids, orders = _moe_model(train=True)
    contract = EngineContract(attention=AttentionArithmetic() if engine_kernels().cpu_has_amx() else VEC, linears=orders,
                              moe=MoeKernel("vec", "silu", True, 10, 3))  # fmt: skip
    compiled, policy, backend = _compiled(model, contract)
    rows = torch.full((1, 12), 12, dtype=torch.int32)
    tap = RouteTap(MoeSpec(("l0", "l1"), 10, 3), intercept=False)
    with policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)), tap:
        loss = compiled(input_ids=ids, use_cache=False).logits.float().square().mean()
        loss.backward()
    assert backend.reports[0].rewrites.get("engine-moe") == 2
    tap.check_complete()  # both layers routed by the contract's op, reported to the tap
    assert all(u.shape == (12, 3) for u in tap.used)
    for name, p in model.named_parameters():
        if ".mlp." in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.needs_transformers
def test_a_contract_that_read_no_moe_kernel_refuses_the_experts_with_the_reason() -> None:
    model, ids, orders = _moe_model()
    why = "the engine's MoE is not of the form the contract follows: the portable (vec) fused experts"
    contract = EngineContract(attention=VEC, linears=orders, unmatched=(("moe", why),))
    _refused(model, ids, orders, contract, r"mixture-of-experts routing \(topk\).*portable \(vec\) fused experts.* at model.layers.0.mlp")


@pytest.mark.needs_transformers
def test_a_router_with_a_score_bias_is_refused() -> None:
    """A router that adds a correction bias to its scores before the top-k (DeepSeek-V3's noaux_tc) chooses its experts
    otherwise than the engine's plain top-k: refused, naming the op."""
    import types

    import torch.nn.functional as F

    model, ids, orders = _moe_model()

    def biased(self: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        scores = torch.sigmoid(logits) + self.correction
        _, indices = torch.topk(scores, self.top_k, dim=-1)
        return logits, torch.sigmoid(logits).gather(-1, indices).to(logits.dtype), indices

    for layer in model.model.layers:
        layer.mlp.gate.correction = torch.zeros(10)
        layer.mlp.gate.forward = types.MethodType(biased, layer.mlp.gate)
    contract = EngineContract(attention=VEC, linears=orders, moe=MoeKernel("vec", "silu", True, 10, 3))
    _refused(model, ids, orders, contract, r"the router at model.layers.0.mlp.gate computes its top-k from .*add")


@pytest.mark.needs_transformers
def test_the_routes_tap_leaves_the_precision_pass_as_it_is() -> None:
    from fx_precision.backend import make_precision_backend
    from fx_precision.routes import MoeSpec, RouteTap

    model, ids, _ = _moe_model()
    casts = []
    for tapped in (False, True):
        policy = fxp.PrecisionPolicy(gather=torch.float32, compute=BF16)
        backend = make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager")
        compiled = torch.compile(model, backend=backend)
        torch._dynamo.reset()
        tap = RouteTap(MoeSpec(("l0", "l1"), 10, 3)) if tapped else None
        with torch.no_grad(), policy.forward_context("cpu"):
            if tap is not None:
                with tap:
                    compiled(input_ids=ids, use_cache=False)
            else:
                compiled(input_ids=ids, use_cache=False)
        casts.append(sorted((str(c.kind), c.of, str(c.to)) for r in backend.reports for c in r.casts))
    assert casts[0] == casts[1] and casts[0]


def test_the_written_out_derivatives_are_autograds() -> None:
    from fx_precision.contract.moe import fused_moe_backward, moe_route_backward

    x, w13, w2, _, _ = _experts(9, 32, 16, 5, 2, seed=3)
    x, w13, w2 = (t.float() for t in (x, w13, w2))
    logits = torch.randn(9, 5, dtype=torch.float32)
    for renormalize in (True, False):
        weights, ids = engine_route(logits.to(BF16), 2, renormalize)
        leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2, weights)]
        grad = torch.randn(9, 32)
        want = torch.autograd.grad(experts_reference(*leaves, ids), leaves, grad)
        got = fused_moe_backward(grad, x, w13, w2, weights, ids)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, want, strict=True))
        # bf16 operands (training): the GEMMs in bf16 as the model's autograd runs them, close to the fp32 derivatives
        low = fused_moe_backward(grad.to(BF16), *(t.to(BF16) for t in (x, w13, w2, weights)), ids)
        assert [t.dtype for t in low] == [BF16] * 4
        assert all(float((a.float() - b).norm() / b.norm()) < 2e-2 for a, b in zip(low, want, strict=True))
        lx = logits.clone().requires_grad_(True)
        chosen = lx.gather(-1, ids)
        w = torch.softmax(chosen, -1) if renormalize else (chosen - torch.logsumexp(lx, -1, keepdim=True)).exp()
        g = torch.randn(9, 2)
        (want_logits,) = torch.autograd.grad(w, lx, g)
        assert torch.allclose(moe_route_backward(g, logits, ids, renormalize), want_logits, rtol=1e-4, atol=1e-6)
