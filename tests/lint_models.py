"""Small hand-written models with one dtype hazard each, for lint and backend tests."""

from __future__ import annotations

import torch
from torch import nn


class LlamaRMSNorm(nn.Module):
    """``weight * x.to(input_dtype)``: an fp32 weight promotes the bf16 result back to fp32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(input_dtype)


class NormMLP(nn.Module):
    """linear -> LlamaRMSNorm -> linear -> LlamaRMSNorm -> linear (two norms, two sources)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.norm1 = LlamaRMSNorm(dim)
        self.mid = nn.Linear(dim, dim)
        self.norm2 = LlamaRMSNorm(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm2(self.mid(self.norm1(self.inp(x)))))


class SoftmaxFp32(nn.Module):
    """Attention-like scores computed in fp32 and returned to the activation dtype: an fp32 island."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        probs = torch.softmax(q.float() @ q.float().transpose(-1, -2), dim=-1).to(q.dtype)
        return self.o(probs @ q)


class Fp32Residual(nn.Module):
    """An intended fp32 residual stream: ``h = x.float() + block(x)`` flows out of the module."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.block = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() + self.block(x)


class ResidualOnWideInput(nn.Module):
    """``x + mlp(x)``: a wide input keeps the residual wide."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class RoundTrip(nn.Module):
    def __init__(self, dim: int = 16, between: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        wide = h.float()
        if self.between:
            wide = wide.exp()
        return self.lin(wide.to(h.dtype))


class EmbedMLP(nn.Module):
    """``embed -> mlp(Linear, SiLU, Linear)``: the MLP's weights feed autocast-covered linears only."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids).to(torch.bfloat16))


class WithGraphBreak(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.a(h)
        torch._dynamo.graph_break()
        return h + self.b(h)


class EmbedLlamaNorm(nn.Module):
    """``embed -> LlamaRMSNorm -> linear``: the norm's promotion is masked while the embedding leaks.

    As traced under bf16 autocast with fp32 weights, ``h.to(input_dtype)`` is ``.to(fp32)`` and the
    norm's multiply a mere propagation; once the embedding's output is cast it is a source itself.
    """

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = LlamaRMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


class TokEmbeddingsDecoder(nn.Module):
    """The hand-written decoder with its embedding named as other training frameworks name it
    (``tok_embeddings``): nothing here is called ``embed_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        from fx_precision.tools.toy_decoder import ToyDecoder

        toy = ToyDecoder()
        self.vocab_size = toy.vocab_size
        self.tok_embeddings = toy.model.embed_tokens
        self.layers = toy.model.layers
        self.norm = toy.model.norm
        self.output = toy.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class AbsolutePositions(nn.Module):
    """GPT-2's input: ``wte(ids) + wpe(positions)``, the position embedding in a module of its own."""

    def __init__(self, vocab: int = 32, positions: int = 16, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.head(self.wte(ids) + self.wpe(positions))


class MaskedAttention(nn.Module):
    """Eager attention: bf16 scores plus an additive mask, softmax in fp32, back to the input dtype."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(h) @ self.k(h).transpose(-1, -2) + mask
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(h.dtype) @ h


class MaskFromStream(nn.Module):
    """transformers' causal mask: built at the embedding's dtype and filled with ``finfo(dtype).min``."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = MaskedAttention(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        dtype = h.dtype
        n = ids.shape[-1]
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
        mask = torch.where(causal, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
        return self.head(self.attn(h, mask))
