"""The log-prob of every next token, as an engine's sampler returns it.

    logits_of(output)                                                 the logits of a model output (tensor or .logits)
    token_logprobs(logits, ids, form, temperature, prompt_lens)      [B, T-1] fp32
    ├── raw        fp32 log_softmax of the logits as they are (bf16 under autocast)  (vLLM's default: raw_logprobs)
    └── processed  of the fp32 logits divided by the temperature (a [rows, 1] fp32 divisor, as vLLM's sampler
                   divides) at sampled positions; prompt positions stay raw (the engine's prompt log-probs skip the
                   sampling processors). At temperature 0 (greedy) or 1 the two are one computation.

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


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, form: LogprobForm = LogprobForm.RAW, temperature: float = 1.0,
                   prompt_lens: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
    """[B, T-1]: the log-prob of ``ids[:, 1:]`` under ``logits[:, :-1]`` (module docstring). ``prompt_lens``: each row's
    prompt length (the positions at and past it were sampled; default: the whole row sampled)."""
    x = logits[:, :-1].float()
    target = ids[:, 1:].long().unsqueeze(-1)
    raw = torch.log_softmax(x, -1).gather(-1, target).squeeze(-1)
    if form is LogprobForm.RAW or temperature in (0.0, 1.0):
        return raw
    rows, steps = x.shape[0], x.shape[1]
    divisor = torch.full((rows * steps, 1), float(temperature), dtype=torch.float32)
    processed = torch.log_softmax(x.reshape(rows * steps, -1) / divisor, -1).reshape(x.shape).gather(-1, target).squeeze(-1)
    lens = list(prompt_lens) if prompt_lens is not None else [1] * rows
    sampled = torch.arange(1, steps + 1).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)  # token p + 1 was sampled
    return torch.where(sampled, processed, raw)
