"""Policy resolution: cast_forward_inputs and the per-architecture registry."""

from __future__ import annotations

import pytest
import torch

from fx_precision import PrecisionError
from fx_precision.archs.gated_delta_net import is_gated_delta_net
from fx_precision.policy import PrecisionPolicy, resolve_policy
from fx_precision.spec import ModuleSel, Rule, parse_precision_rules


def tiny(cls_name: str, **kw: object) -> object:
    import transformers

    return getattr(transformers, cls_name)(**kw)


@pytest.mark.needs_transformers
def test_qwen3_5_fp32_gather_bf16_compute_yields_exactly_the_embedding_rule() -> None:
    from fx_precision.tools.zoo import qwen3_5_config

    policy = resolve_policy(qwen3_5_config("qwen3_5-tiny"), gather="fp32", compute="bf16")
    assert policy.spec.rules == (Rule(ModuleSel(fqn="*embed_tokens"), gather=torch.bfloat16),)
    assert policy.cast_forward_inputs is False


@pytest.mark.parametrize(
    "config",
    [
        lambda: tiny("Qwen3Config", num_hidden_layers=2),
        lambda: tiny("LlamaConfig", num_hidden_layers=2),
    ],
)
@pytest.mark.needs_transformers
def test_non_gated_delta_net_architecture_gets_no_rule(config: object) -> None:
    policy = resolve_policy(config(), gather="fp32", compute="bf16")  # type: ignore[operator]
    assert len(policy.spec) == 0


@pytest.mark.needs_transformers
def test_gated_delta_net_recognised_by_model_type_or_layer_types() -> None:
    assert is_gated_delta_net(tiny("Qwen3NextConfig", num_hidden_layers=2))
    assert is_gated_delta_net(tiny("Qwen3_5MoeTextConfig", num_hidden_layers=2))

    class Custom:
        model_type = "my_hybrid"
        layer_types = ("full_attention", "linear_attention")

    assert is_gated_delta_net(Custom())
    assert not is_gated_delta_net(None)


@pytest.mark.needs_transformers
def test_rule_is_self_activating() -> None:
    from fx_precision.tools.zoo import qwen3_5_config

    cfg = qwen3_5_config("qwen3_5-tiny")
    assert len(resolve_policy(cfg, gather="fp32", compute=None).spec) == 0  # no autocast
    assert len(resolve_policy(cfg, gather="bf16", compute="bf16").spec) == 0  # already agree
    assert resolve_policy(cfg, gather="fp32", compute=None).cast_forward_inputs is True


@pytest.mark.needs_transformers
def test_user_rules_come_after_arch_rules_and_win() -> None:
    from fx_precision.tools.zoo import qwen3_5_config

    user = parse_precision_rules("*embed_tokens=fp32")
    policy = resolve_policy(qwen3_5_config("qwen3_5-tiny"), gather="fp32", compute="bf16", spec=user)
    assert policy.spec.rules[-1] == user.rules[0]
    model = tiny("Qwen3_5ForCausalLM", config=qwen3_5_config("qwen3_5-tiny"))
    assert policy.plan(model).param("model.embed_tokens.weight").gather == torch.float32


def test_explicit_cast_forward_inputs_is_kept_and_dtypes_validated() -> None:
    assert PrecisionPolicy(compute=torch.bfloat16, cast_forward_inputs=True).cast_forward_inputs is True
    with pytest.raises(PrecisionError, match=r"PrecisionPolicy\.gather"):
        PrecisionPolicy(gather=torch.int32)


def test_forward_context_autocasts_on_the_device_type() -> None:
    policy = PrecisionPolicy(compute=torch.bfloat16)
    with policy.forward_context("cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        y = torch.nn.functional.linear(torch.randn(2, 2), torch.randn(2, 2))
    assert y.dtype == torch.bfloat16
    with PrecisionPolicy().forward_context("cpu"):
        assert not torch.is_autocast_enabled("cpu")
