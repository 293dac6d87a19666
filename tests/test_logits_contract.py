"""The engine's logits processing under the contract: Granite's logits scaling as vLLM's logits processor computes it
(``logits *= 1 / logits_scaling`` in bf16), and the refusals where the model and the engine's record disagree."""

from __future__ import annotations

import pytest
import torch

import fx_precision as fxp
from fx_precision.contract import AttentionArithmetic, EngineContract
from fx_precision.contract.batch_rows import EngineRows, engine_rows
from fx_precision.contract.kernels import engine_kernels
from fx_precision.contract.linear_order import LinearOrders, candidate_orders
from fx_precision.contract.logits import LogitsForm, logits_scale
from fx_precision.errors import PrecisionError

BF16 = torch.bfloat16
VEC = AttentionArithmetic(scores="vec", exp="libm", reduce="avx2", p_bf16=False, fma=False, store="truncate")  # the AVX2 build's


def test_the_scale_op_is_the_engines_in_place_multiply_and_not_the_models_division() -> None:
    """x * (1 / 6) rounded once in bf16, as ``logits *= scale``, eager and under Inductor. The model's x / 6 rounds the
    same in eager mode, but Inductor fuses it into the log-softmax that widens it again and drops the rounding: behind
    the op it stays."""
    torch.manual_seed(0)
    x = (torch.randn(64, 512) * 4).to(BF16)
    engine = x.clone()
    engine *= 1.0 / 6.0
    ours = logits_scale(x, 1.0 / 6.0)
    assert torch.equal(ours.view(torch.int16), engine.view(torch.int16))
    reference = torch.compile(lambda t: t.float().log_softmax(-1), backend="inductor")(engine).view(torch.int32)  # the engine's bf16 in
    compiled = torch.compile(lambda t: torch.ops.fxp_engine.logits_scale(t, 1.0 / 6.0).float().log_softmax(-1), backend="inductor")
    assert torch.equal(compiled(x).view(torch.int32), reference)
    fused = torch.compile(lambda t: (t / 6.0).float().log_softmax(-1), backend="inductor")
    assert not torch.equal(fused(x).view(torch.int32), reference)
    grad = torch.randn(64, 512, dtype=BF16)
    leaf = x.clone().requires_grad_()
    logits_scale(leaf, 0.25).backward(grad)
    assert torch.equal(leaf.grad, grad * 0.25)


@pytest.mark.parametrize(
    ("data", "error"),
    [({"scale": 0.0, "soft_cap": None}, "contract.logits.scale"), ({"scale": 1.0, "soft_cap": -1}, "contract.logits.soft_cap"),
     ({"scale": 1.0}, "contract.logits: an object")],
)  # fmt: skip
def test_the_logits_form_is_typed_on_read(data: dict, error: str) -> None:
    with pytest.raises(PrecisionError, match=error):
        LogitsForm.from_dict(data)
    assert LogitsForm.from_dict(LogitsForm(1 / 6, 30.0).to_dict()) == LogitsForm(1 / 6, 30.0)
    assert EngineContract.from_dict(EngineContract(logits=LogitsForm(0.125)).to_dict()).logits == LogitsForm(0.125)


def _granite_logits(logits_scaling: float, form: LogitsForm | None) -> torch.Tensor:
    from transformers import GraniteConfig, GraniteForCausalLM

    from fx_precision.backend import make_precision_backend
    from fx_precision.contract.linear_order import engine_linear_shapes

    config = GraniteConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22,
                           attention_multiplier=0.03125, logits_scaling=logits_scaling)  # fmt: skip
    torch.manual_seed(0)
    model = GraniteForCausalLM(config).eval()
    ids = torch.randint(0, 512, (1, 12))
    orders = LinearOrders.uniform(engine_linear_shapes(model, input_ids=ids[:, :4]), [12], lambda k: candidate_orders(k, 1)[0])
    attention = AttentionArithmetic() if engine_kernels().cpu_has_amx() else VEC
    policy = fxp.PrecisionPolicy(gather=BF16, compute=BF16, cast_forward_inputs=False,
                                 contract=EngineContract(attention=attention, linears=orders, logits=form))  # fmt: skip
    compiled = torch.compile(model, backend=make_precision_backend(policy=policy, plan=policy.plan(model), inner="aot_eager"))
    rows = torch.full((1, 12), 12, dtype=torch.int32)
    with torch.no_grad(), policy.forward_context("cpu"), engine_rows(EngineRows(rows, rows, orders)):
        return compiled(input_ids=ids, use_cache=False).logits


@pytest.mark.needs_transformers
def test_granites_logits_scaling_is_the_engines_multiply_by_its_reciprocal() -> None:
    """A Granite (embedding, residual, attention multipliers; logits_scaling 6) under the contract: its logits are the
    unscaled model's (the same GEMM, in the engine's order) times 1 / 6 in bf16 (``logits *= scale``), bit for bit."""
    import torch._dynamo

    torch._dynamo.reset()
    scaled = _granite_logits(6.0, LogitsForm(1.0 / 6.0))
    torch._dynamo.reset()
    plain = _granite_logits(1.0, LogitsForm())
    engine = plain.clone()
    engine *= 1.0 / 6.0
    assert scaled.dtype == BF16 and torch.equal(scaled.view(torch.int16), engine.view(torch.int16))


@pytest.mark.needs_transformers
@pytest.mark.parametrize(
    ("logits_scaling", "form", "error"),
    [(6.0, None, "logits scaled by 0.16666666666666666, and the rollout recorded no logits processing"),
     (6.0, LogitsForm(0.2), "by 0.16666666666666666, the engine by 0.2"),
     (1.0, LogitsForm(1 / 6), "by 1.0, the engine by 0.16666666666666666")],
)  # fmt: skip
def test_logits_scaling_the_engine_did_not_record_is_refused_in_one_line(logits_scaling: float, form: LogitsForm | None,
                                                                        error: str) -> None:  # fmt: skip
    import torch._dynamo

    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:  # Dynamo wraps a backend's error (BackendCompilerFailed)
        _granite_logits(logits_scaling, form)
    refusal = fxp.precision_error_in(raised.value)
    assert refusal is not None and error in str(refusal) and "\n" not in str(refusal)
