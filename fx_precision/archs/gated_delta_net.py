"""GatedDeltaNet architectures (Qwen3.5, Qwen3.5-MoE, Qwen3.6, Qwen3-Next): embedding at compute dtype.

    Qwen3_5ForCausalLM
    ├── model.embed_tokens     F.embedding: autocast does not cover it; a weight gathered at fp32
    │                          seeds an fp32 residual stream that type_as and residual adds carry
    │                          through every layer.  -> gather it at the compute dtype
    └── model.layers.*         (gather dtype unchanged)

Self-activating: no rule unless a compute dtype is set and differs from the gather dtype.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fx_precision.archs.registry import DtypeAxes, input_embedding_fqns, register_arch
from fx_precision.spec import ModuleSel, PrecisionSpec, Rule

GATED_DELTA_NET_MODEL_TYPES = frozenset(
    {
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_6",
        "qwen3_6_text",
        "qwen3_6_moe",
        "qwen3_6_moe_text",
        "qwen3_next",
    }
)


def is_gated_delta_net(config: Any) -> bool:
    """Recognised by ``model_type`` or by a ``linear_attention`` entry in ``layer_types``."""
    if config is None:
        return False
    text = getattr(config, "text_config", None)
    for cfg in (config, text):
        if cfg is None:
            continue
        if getattr(cfg, "model_type", None) in GATED_DELTA_NET_MODEL_TYPES:
            return True
        if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
            return True
    return False


@register_arch
def embedding_at_compute_dtype(config: Any, policy: DtypeAxes, model: nn.Module | None = None) -> PrecisionSpec:
    """The input embedding (by role when the model is known; ``*embed_tokens`` from a config alone)."""
    if not is_gated_delta_net(config) or policy.compute is None or policy.compute == policy.gather:
        return PrecisionSpec()
    fqns = input_embedding_fqns(model) if model is not None else ["*embed_tokens"]
    return PrecisionSpec(tuple(Rule(ModuleSel(fqn=fqn), gather=policy.compute) for fqn in fqns))
