"""The log-prob of every next token, as an engine's sampler returns it.

    logits_of(output)                                                 the logits of a model output (tensor or .logits)
    token_logprobs(logits, ids, form, temperature, prompt_lens, top_k, top_p)      [B, T-1] fp32
    ├── raw        fp32 log_softmax of the logits as they are (bf16 under autocast)  (vLLM's default: raw_logprobs);
    │              top-k and top-p do not enter
    └── processed  processed_logprobs(rows, temperature, top_k, top_p) at sampled positions: the fp32 logits divided
                   by the temperature (a [rows, 1] fp32 divisor, as vLLM's sampler divides), then top-k and top-p
                   as its CPU sampler masks them (vLLM's apply_top_k_top_p_pytorch: the k-th largest value kept with
                   its ties; a sort, an fp32 softmax and a cumulative sum, every token whose sum is at most 1 - p
                   masked, the largest always kept), then log_softmax over what is left; prompt positions stay
                   raw (the engine's prompt log-probs skip the sampling processors). With no top-k or top-p, at
                   temperature 0 (greedy) or 1 the two are one computation.

The contract's ``logprobs`` entry (LogprobForm) says which one an engine returned; ``match_logprobs`` in
contract/probing.py reads it off the engine's own sampled logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fx_precision.contract.vocabulary import LogprobForm
from fx_precision.errors import PrecisionError


def logits_of(output: object) -> torch.Tensor:
    """The logits tensor of a model output (plain tensor or a transformers ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise PrecisionError(f"cannot find logits in a {type(output).__name__}; return a tensor or an object with .logits")


def masks(top_k: int, top_p: float) -> bool:
    """Whether top-k (0: off) or top-p (1: off) removes tokens from the sampler's distribution."""
    return top_k > 0 or top_p < 1.0


def processing_is_identity(temperature: float, top_k: int = 0, top_p: float = 1.0) -> bool:
    """Whether the processed log-probs are the raw ones: no mask, at temperature 0 (greedy) or 1."""
    return temperature in (0.0, 1.0) and not masks(top_k, top_p)


def processed_logprobs(x: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[rows, vocab] fp32 logits -> the sampler's processed log-probs (module docstring), row by row as vLLM's CPU
    sampler computes them: each row's result depends on that row alone."""
    x = x.float()
    if temperature not in (0.0, 1.0):
        x = x / torch.full((x.shape[0], 1), float(temperature), dtype=torch.float32)
    if masks(top_k, top_p):
        ordered, index = x.sort(dim=-1, descending=False)
        if top_k > 0:
            kth = ordered[:, max(ordered.shape[1] - top_k, 0)].unsqueeze(1)  # the k-th largest; its ties stay
            ordered.masked_fill_(ordered < kth, -float("inf"))
        if top_p < 1.0:
            total = torch.cumsum(ordered.softmax(dim=-1), dim=-1)
            drop = total <= 1 - torch.full((x.shape[0],), float(top_p), dtype=torch.float32).unsqueeze(1)
            drop[:, -1] = False  # the largest always stays
            ordered.masked_fill_(drop, -float("inf"))
        x = x.scatter(dim=-1, index=index, src=ordered)
    return x.log_softmax(dim=-1, dtype=torch.float32)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, form: LogprobForm = LogprobForm.RAW, temperature: float = 1.0,
                   prompt_lens: Sequence[int] | None = None, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:  # fmt: skip
    """[B, T-1]: the log-prob of ``ids[:, 1:]`` under ``logits[:, :-1]`` (module docstring). ``prompt_lens``: each row's
    prompt length (the positions at and past it were sampled; default: the whole row sampled)."""
    x = logits[:, :-1].float()
    target = ids[:, 1:].long().unsqueeze(-1)
    raw = torch.log_softmax(x, -1).gather(-1, target).squeeze(-1)
    if form is LogprobForm.RAW or processing_is_identity(temperature, top_k, top_p):
        return raw
    rows, steps = x.shape[0], x.shape[1]
    processed = processed_logprobs(x.reshape(rows * steps, -1), temperature, top_k, top_p)
    processed = processed.reshape(x.shape).gather(-1, target).squeeze(-1)
    lens = list(prompt_lens) if prompt_lens is not None else [1] * rows
    sampled = torch.arange(1, steps + 1).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)  # token p + 1 was sampled
    return torch.where(sampled, processed, raw)
