"""Which rows the engine computed in a small batch: its linear kernels switch arithmetic on the batch size.

vLLM's CPU linears with small weights (AMX machines) run a different kernel when a forward holds at
most 4 rows (a pairwise bf16 dot product, VDPBF16PS) than above (AMX brgemm, as torch's linear):
a decode step of up to 4 running requests takes one path, the prefill of a long prompt the other. A
teacher-forced training forward computes every row in one batch, so it must be told which rows the
engine computed small. The rollout records each engine forward's rows and each logits computation::

    engine steps     [[(position, token), ...] per forward]      logits calls   [(step, rows), ...]
    row plan of sequence s (T tokens, prompt P)
    ├── body[r]      the forward that computed row r had <= 4 rows          (all the body's linears)
    └── logits[r]    the logits of row r (for token r + 1) were computed in a call of <= 4 rows:
                     r < P - 1: the prompt-logprob call of this request in that step (its rows < P - 1)
                     r >= P - 1: the sampling call of that step (one row per request in the step)

``check_logits_calls`` compares the calls this predicts with the ones recorded; a difference means the
engine batched its logits otherwise, and the contract says it does not follow them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from fx_precision.errors import PrecisionError


@dataclass(frozen=True)
class RowPlan:
    """Per token row of one sequence: computed by the engine in a small batch (body linears, logits)."""

    body: tuple[bool, ...]
    logits: tuple[bool, ...]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([self.body], dtype=torch.bool), torch.tensor([self.logits], dtype=torch.bool)


def steps_of(sequences: list[Any], steps: list[list[tuple[int, int]]]) -> list[list[int | None]]:
    """For each sequence, the engine step that computed each of its rows (None: never computed).

    A row is the (position, token) it fed; a sequence's rows come in non-decreasing steps, and each
    row of a step is one sequence's: sequences claim rows in order, the earliest step that fits."""
    available: Counter[tuple[int, int, int]] = Counter()
    where: dict[tuple[int, int], list[int]] = {}
    for i, rows in enumerate(steps):
        for position, token in rows:
            available[(i, int(position), int(token))] += 1
            if i not in where.setdefault((int(position), int(token)), []):
                where[(int(position), int(token))].append(i)
    out = []
    for s in sequences:
        found: list[int | None] = []
        floor = 0
        for r, token in enumerate(s.tokens):
            step = next((i for i in where.get((r, int(token)), []) if i >= floor and available[(i, r, int(token))] > 0), None)
            if step is not None:
                available[(step, r, int(token))] -= 1
                floor = step
            found.append(step)
        out.append(found)
    return out


def row_plans(sequences: list[Any], engine: dict[str, Any], small: int) -> list[RowPlan]:
    """The row plan of every sequence (see the module docstring); ``small``: the largest small batch."""
    steps = [[(int(p), int(t)) for p, t in rows] for rows in engine.get("steps") or []]
    if not steps:
        raise PrecisionError("the engine dump records no forward steps; write it again with fx-precision rollout of this version")
    step_of = steps_of(sequences, steps)
    requests = Counter()
    for found in step_of:
        for step in set(f for f in found if f is not None):
            requests[step] += 1
    plans = []
    for s, found in zip(sequences, step_of, strict=True):
        body = tuple(f is not None and len(steps[f]) <= small for f in found)
        logits = []
        for r in range(len(s.tokens) - 1):
            step = found[r]
            if step is None:
                logits.append(False)
            elif r < s.prompt_len - 1:
                chunk = sum(1 for q in range(len(s.tokens)) if found[q] == step and q < s.prompt_len - 1)
                logits.append(chunk <= small)
            else:
                logits.append(requests[step] <= small)
        plans.append(RowPlan(body, tuple(logits)))
    return plans


def check_logits_calls(sequences: list[Any], engine: dict[str, Any]) -> str | None:
    """None when the recorded logits computations are the ones the plan assumes, else what differs."""
    steps = [[(int(p), int(t)) for p, t in rows] for rows in engine.get("steps") or []]
    predicted: Counter[tuple[int, int]] = Counter()
    requests: Counter[int] = Counter()
    for s, found in zip(sequences, steps_of(sequences, steps), strict=True):
        for step in set(f for f in found if f is not None):
            requests[step] += 1
            prompt_rows = sum(1 for q, f in enumerate(found) if f == step and q < s.prompt_len - 1)
            if prompt_rows:
                predicted[(step, prompt_rows)] += 1
    for step, n in requests.items():
        predicted[(step, n)] += 1
    recorded = Counter((int(a), int(b)) for a, b in engine.get("logits_calls") or [])
    if recorded == predicted:
        return None
    missing = sorted((predicted - recorded).elements())[:4]
    extra = sorted((recorded - predicted).elements())[:4]
    return f"the engine computed logits in other batches than assumed (expected but absent: {missing}; recorded, unexpected: {extra})"
