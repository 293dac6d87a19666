"""Prompts for a rollout: synthetic (seeded) or read from a file, checked against the model before an engine starts.

synthetic_prompts(vocab, lengths, seed)     one prompt of random token ids per length
read_prompts(path)                          a JSON list of token-id lists, strictly (UTF-8, integers, bounds)
check_prompts(prompts, vocab, ...)          every id in the vocabulary, every prompt in the engine's bounds
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from fx_precision.errors import PrecisionError

MAX_PROMPTS = 4096  # one engine call; more is a loop of calls
MAX_PROMPT_FILE = 64 << 20  # bytes: a prompts file is token ids, not a corpus


def synthetic_prompts(vocab: int, lengths: Sequence[int], seed: int) -> tuple[tuple[int, ...], ...]:
    """Token ids from a fixed seed: one prompt per length."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randint(0, vocab, (n,), generator=gen).tolist()) for n in lengths)


def read_prompts(path: str) -> tuple[tuple[int, ...], ...]:
    """A JSON file holding a list of non-empty lists of token ids (integers; booleans are not ids)."""
    file = Path(path)
    try:
        size = file.stat().st_size
        if size > MAX_PROMPT_FILE:
            raise PrecisionError(f"--prompts {path}: {size} bytes, over the limit of {MAX_PROMPT_FILE}; a prompts file holds token ids")
        data = json.loads(file.read_bytes().decode("utf-8"))
    except PrecisionError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PrecisionError(f"--prompts {path}: not a readable UTF-8 JSON file ({type(exc).__name__}: {str(exc)[:200]})") from None
    shape = "a JSON list of non-empty lists of token ids, e.g. [[1, 2, 3], [4, 5]]"
    if not isinstance(data, list) or not data:
        raise PrecisionError(f"--prompts {path}: expected {shape}")
    if len(data) > MAX_PROMPTS:
        raise PrecisionError(f"--prompts {path}: {len(data)} prompts, over the limit of {MAX_PROMPTS} per rollout; split the file")
    for i, prompt in enumerate(data):
        if not isinstance(prompt, list) or not prompt:
            raise PrecisionError(f"--prompts {path}: prompt {i} is not a non-empty list; expected {shape}")
        bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None or any(isinstance(t, bool) for t in prompt):
            raise PrecisionError(f"--prompts {path}: prompt {i} holds {bad!r}, not a token id (an integer)")
    return tuple(tuple(p) for p in data)


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int, max_len: int, max_tokens: int, where: str, min_len: int = 1) -> None:
    """Every prompt's ids in ``[0, vocab)``, its length at least ``min_len`` (the shortest prompt the engine survives)
    and, with ``max_tokens`` sampled, within the engine's ``max_len`` positions."""
    if not prompts:
        raise PrecisionError("a rollout needs at least one prompt")
    if len(prompts) > MAX_PROMPTS:
        raise PrecisionError(f"{len(prompts)} prompts, over the limit of {MAX_PROMPTS} per rollout")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise PrecisionError(f"prompt {i}: token id {bad[0]} is outside the vocabulary of {where} (0..{vocab - 1})")
        if len(prompt) < min_len:
            raise PrecisionError(
                f"prompt {i}: {len(prompt)} token(s); this engine build needs prompts of at least {min_len} tokens (its CPU attention "
                "stops on shorter ones): lengthen it"
            )
        if len(prompt) + max_tokens > max_len:
            raise PrecisionError(
                f"prompt {i}: {len(prompt)} tokens + {max_tokens} generated exceed the {max_len} positions of {where}; "
                "shorten it or generate fewer"
            )
