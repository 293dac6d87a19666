"""A small hand-written decoder with the dtype hazards of real LLMs, no ``transformers`` needed.

ToyDecoder
├── model.embed_tokens     nn.Embedding          F.embedding: not autocast-covered
├── model.layers.N         ToyDecoderLayer
│   ├── input_layernorm    ToyRMSNorm            x.float() ... .type_as(x)
│   ├── self_attn          ToyAttention          q/k/v/o Linear + SDPA
│   ├── post_attention_layernorm
│   └── mlp                ToyMLP                gate/up/down Linear + SiLU
│   (two residual adds: promotion carries a wide stream)
├── model.norm             ToyRMSNorm
└── lm_head                Linear
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyRMSNorm(nn.Module):
    """Qwen/Llama-style RMSNorm: fp32 island inside, ``type_as(x)`` at the end."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).type_as(x)


class ToyAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, d))


class ToyMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ToyDecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = ToyRMSNorm(dim)
        self.self_attn = ToyAttention(dim, heads)
        self.post_attention_layernorm = ToyRMSNorm(dim)
        self.mlp = ToyMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ToyBackbone(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(ToyDecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.norm = ToyRMSNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class ToyDecoder(nn.Module):
    """``forward(input_ids) -> logits``; ``vocab_size`` tells drivers which token ids to draw."""

    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.model = ToyBackbone(vocab, dim, layers, heads, hidden)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))
