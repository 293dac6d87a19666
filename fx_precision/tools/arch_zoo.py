"""Tiny configs of real ``transformers`` decoder architectures, built on CPU from code (no download).

Each entry names the dtype patterns it carries, so the sweep covers every pattern the backend must
fix or leave alone::

    llama-norm      weight * x.to(input_dtype): a promotion masked while the embedding leaks
    qk-norm         RMSNorm on q and k heads (inputs from bf16 linears: visible in round 0)
    gemma-norm      x.float() * (1 + weight.float()), then type_as: an fp32 island, contained
    layernorm-bias  nn.LayerNorm with bias (autocast runs layer_norm in fp32)
    kv-cache        transformers' cache: torch.cat onto an empty placeholder of the traced dtype
    abs-positions   learned absolute positions: a second F.embedding added to the first
    moe             router softmax in fp32, top-k, experts (custom grouped-mm op at weight dtype)
    shared-expert   a dense expert beside the routed ones, gated by a sigmoid
    mla             DeepSeek multi-head latent attention (low-rank q/kv with their own norms)
    sliding-window  local attention layers
    gated-delta-net linear attention with an fp32 recurrent state
    tied            input and output embeddings are one parameter

GatedDeltaNet models run batch 1 in the sweep: torch's own ``aot_eager`` backward fails on them at
batch >= 2 ("view size is not compatible with input tensor's size and stride"), with or without
this project; Inductor runs the same graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fx_precision.errors import PrecisionError
from fx_precision.hf import require_transformers

_DIMS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_GDN = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# What vLLM's CPU build runs of a GatedDeltaNet hybrid: linear head dims 64 or 128 (its chunk kernel refuses 32), three
# linear-attention layers to one full-attention layer (Qwen3-Next's and Qwen3.5's pattern), 4 layers
_GDN_ENGINE = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


@dataclass(frozen=True)
class Arch:
    """One architecture: ``transformers`` config and model class names, config overrides, patterns."""

    name: str
    config: str
    model: str
    overrides: dict[str, Any] = field(default_factory=dict)
    patterns: tuple[str, ...] = ()
    batch: int = 2
    engine: dict[str, Any] = field(default_factory=dict)  # over ``overrides`` at the checkpoint writer's sizes: what vLLM's CPU build runs

    def build(self, seed: int = 0, dims: dict[str, Any] | None = None) -> nn.Module:
        """The model at the sweep's tiny sizes, or at ``dims`` (the checkpoint writer's engine sizes, where the
        architecture's ``engine`` overrides apply over its own)."""
        transformers = require_transformers()
        kwargs = {**(dims or _DIMS), **self.overrides, **(self.engine if dims is not None else {})}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}  # None: the config has no such field
        try:
            config = getattr(transformers, self.config)(**kwargs)
            cls = getattr(transformers, self.model)
        except AttributeError as exc:
            raise PrecisionError(f"architecture {self.name!r}: this transformers has no {exc.name or exc}") from exc
        torch.manual_seed(seed)
        return cls(config).float().eval()  # eval: dropout (GPT-2, OPT: 0.1) would make every forward differ

    @property
    def tied(self) -> bool:
        return "tied" in self.patterns


ARCHS: tuple[Arch, ...] = (
    Arch("llama", "LlamaConfig", "LlamaForCausalLM", {}, ("llama-norm", "kv-cache")),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": 4}, ("llama-norm", "kv-cache", "sliding-window")),
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}, ("llama-norm", "kv-cache")),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {}, ("llama-norm", "qk-norm", "kv-cache")),
    Arch(
        "qwen3-tied",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"tie_word_embeddings": True},
        ("llama-norm", "qk-norm", "kv-cache", "tied"),
    ),
    Arch("qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _MOE, ("llama-norm", "qk-norm", "kv-cache", "moe")),
    Arch(
        "qwen2-moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**_MOE, "shared_expert_intermediate_size": 16},
        ("llama-norm", "kv-cache", "moe", "shared-expert"),
    ),
    Arch("mixtral", "MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, ("llama-norm", "moe")),
    Arch(
        "olmoe",
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2},
        ("llama-norm", "qk-norm", "moe", "kv-cache"),
    ),
    Arch(
        "glm4-moe",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1, "head_dim": None},
        ("llama-norm", "moe", "shared-expert", "kv-cache"),
    ),
    Arch(
        "gpt-oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
        ("llama-norm", "moe", "sliding-window", "kv-cache"),
    ),
    Arch(
        "deepseek-v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "head_dim": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
        ("llama-norm", "mla", "moe", "shared-expert", "kv-cache"),
    ),
    Arch("gemma", "GemmaConfig", "GemmaForCausalLM", {}, ("gemma-norm", "kv-cache", "tied")),
    Arch("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4}, ("gemma-norm", "sliding-window", "kv-cache", "tied")),
    Arch(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 4},
        ("gemma-norm", "qk-norm", "sliding-window", "kv-cache", "tied"),
    ),
    Arch("phi3", "Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, ("llama-norm", "kv-cache")),
    Arch("phi", "PhiConfig", "PhiForCausalLM", {}, ("layernorm-bias", "kv-cache")),
    Arch(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
        ("layernorm-bias", "abs-positions", "kv-cache", "tied"),
    ),
    Arch(
        "gpt-bigcode",
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
        ("layernorm-bias", "abs-positions", "kv-cache", "tied"),
    ),
    Arch("opt", "OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}, ("layernorm-bias", "abs-positions", "tied")),
    Arch("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {}, ("layernorm-bias", "kv-cache")),
    Arch("falcon", "FalconConfig", "FalconForCausalLM", {"head_dim": None}, ("layernorm-bias", "kv-cache", "tied")),
    Arch("bloom", "BloomConfig", "BloomForCausalLM", {"n_layer": 2, "n_head": 4}, ("layernorm-bias", "tied")),
    Arch("stablelm", "StableLmConfig", "StableLmForCausalLM", {}, ("layernorm-bias", "kv-cache")),
    Arch(
        "starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 4}, ("layernorm-bias", "sliding-window", "kv-cache")
    ),
    Arch("olmo", "OlmoConfig", "OlmoForCausalLM", {}, ("layernorm-bias", "kv-cache")),
    Arch("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}, ("qk-norm", "kv-cache")),  # (weight * x).to(dtype): an fp32 island
    Arch("cohere", "CohereConfig", "CohereForCausalLM", {}, ("layernorm-bias", "kv-cache", "tied")),
    Arch("granite", "GraniteConfig", "GraniteForCausalLM", {}, ("llama-norm", "kv-cache")),
    Arch(
        "qwen3-next",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**_MOE, **_GDN, "shared_expert_intermediate_size": 16},
        ("gated-delta-net", "moe", "shared-expert", "gemma-norm", "kv-cache"),
        batch=1,
        engine={**_GDN_ENGINE, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},  # every layer MoE (vLLM needs one)
    ),
    Arch(
        "qwen3.5-moe",
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**_MOE, **_GDN, "shared_expert_intermediate_size": 16},
        ("gated-delta-net", "moe", "shared-expert", "gemma-norm", "kv-cache"),
        batch=1,
        engine={**_GDN_ENGINE, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
    ),
    Arch(
        "qwen3.5",
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        {**_GDN, "tie_word_embeddings": True},
        ("gated-delta-net", "gemma-norm", "kv-cache", "tied"),
        batch=1,
        engine=_GDN_ENGINE,
    ),
)
BY_NAME = {arch.name: arch for arch in ARCHS}


def arch(name: str) -> Arch:
    if name not in BY_NAME:
        raise PrecisionError(f"unknown architecture {name!r}; the sweep knows: {', '.join(BY_NAME)}")
    return BY_NAME[name]
