"""Log-prob metrics from the root's logits and token ids (or recorded log-prob records): per-token |delta| max and mean,
K3 KL, the share of bitwise-equal log-probs, prompt and generated apart; fail closed (``comparable``: False and why),
and the ``--fail-above`` gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fx_precision.bit_equality import bit_equal, same_bits
from fx_precision.dump import Dump, Sequence
from fx_precision.errors import PrecisionError
from fx_precision.logprobs import token_logprobs


def _root_logits_and_ids(dump: Dump) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    logits = ids = None
    for record in dump.records:
        if record.fqn != "" or record.call != 0:
            continue
        if record.io == "out" and record.path in ("out", "out.logits", "out[0]") and logits is None:
            logits = record.tensor
        if record.io == "in" and record.tensor is not None and not record.tensor.is_floating_point() and ids is None:
            ids = record.tensor
    return logits, ids


@dataclass(frozen=True)
class LogprobView:
    """One side's per-token log-probs: per sequence, its token ids, prompt length and fp32 log-probs
    of ``tokens[1:]``; ``vocab`` when they were taken from logits here."""

    sequences: list[Sequence]
    logprobs: list[torch.Tensor]
    vocab: int | None
    origin: str
    prompt_recorded: bool = True  # an engine launched as users launch it returns no prompt log-probs (NaN placeholders)


def logprob_view(dump: Dump) -> LogprobView | None:
    """Recorded log-probs (an engine's), else ``log_softmax(logits.float())`` of the root's logits at
    the root's token ids (each batch row one sequence, all prompt), else None."""
    recorded = dump.logprob_records()
    if recorded and dump.sequences:
        by_index = {r.path: r.tensor for r in recorded}
        values = []
        for i, _ in enumerate(dump.sequences):
            tensor = by_index.get(f"seq[{i}]")
            if tensor is None:
                raise PrecisionError(f"dump {dump.source}: sequence {i} has token ids but no log-prob record seq[{i}]")
            values.append(tensor.double())
        prompt = not isinstance(dump.engine, dict) or bool(dump.engine.get("prompt_logprobs", True))
        return LogprobView(list(dump.sequences), values, None, "recorded", prompt)
    logits, ids = _root_logits_and_ids(dump)
    if logits is None or ids is None or logits.dim() != 3 or ids.dim() != 2 or tuple(ids.shape) != tuple(logits.shape[:2]):
        return None
    lp = token_logprobs(logits, ids)
    sequences = [Sequence(tuple(int(t) for t in row), len(row)) for row in ids.tolist()]
    return LogprobView(sequences, [row.double() for row in lp], int(logits.shape[-1]), "from the root's logits")


def _stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float | None]:
    if a.numel() == 0:  # nothing compared: no share to claim
        return {"max": 0.0, "mean": 0.0, "k3_kl": 0.0, "bitwise_share": None, "tokens": 0.0}
    delta = (a - b).abs()
    log_ratio = b - a
    k3 = (log_ratio.exp() - 1) - log_ratio  # Schulman's K3 estimate of KL(a || b) on a's tokens
    return {
        "max": float(delta.max()),
        "mean": float(delta.mean()),
        "k3_kl": float(k3.mean()),
        "bitwise_share": float(bit_equal(a, b).double().mean()),  # bit patterns: -0.0 is not 0.0
        "tokens": float(delta.numel()),
    }


def _not_comparable(why: str) -> dict[str, Any]:
    return {"comparable": False, "why": why}


def logprob_metrics(da: Dump, db: Dump) -> dict[str, Any] | None:
    """Per-token log-probs, side a vs side b: |delta| max and mean, K3 KL, bitwise-equal share, over
    all tokens and split into prompt and generated ones. ``comparable`` is False (``why`` says why)
    when the token ids, lengths, vocabularies or models differ; ``non_finite`` counts NaN/Inf, over
    which nothing is averaged. None: neither side holds log-probs or logits."""
    va, vb = logprob_view(da), logprob_view(db)
    if va is None and vb is None:
        return None
    for view, label, dump in ((va, "a", da), (vb, "b", db)):
        if view is None:
            return _not_comparable(f"side {label} ({dump.source}) holds no log-probs: no logprob records and no root logits with token ids")
    assert va is not None and vb is not None
    if da.model and db.model and da.model != db.model:
        return _not_comparable(f"the dumps are of different models (a: {da.model}, b: {db.model})")
    if va.vocab is not None and vb.vocab is not None and va.vocab != vb.vocab:
        return _not_comparable(f"the vocabularies differ (a: {va.vocab} logits per token, b: {vb.vocab})")
    if len(va.sequences) != len(vb.sequences):
        return _not_comparable(f"side a has {len(va.sequences)} sequence(s), side b {len(vb.sequences)}")
    for i, (sa, sb) in enumerate(zip(va.sequences, vb.sequences, strict=True)):
        if len(sa.tokens) != len(sb.tokens):
            return _not_comparable(f"sequence {i}: {len(sa.tokens)} tokens on side a, {len(sb.tokens)} on side b")
        if sa.tokens != sb.tokens:
            k = next(j for j, (x, y) in enumerate(zip(sa.tokens, sb.tokens, strict=True)) if x != y)
            return _not_comparable(f"sequence {i}: the token ids differ at position {k} (a: {sa.tokens[k]}, b: {sb.tokens[k]})")
    # which tokens are generated: the side that recorded them knows (an engine's dump); else all are prompt
    prompt_lens = [max(sa.prompt_len if va.origin == "recorded" else 0, sb.prompt_len if vb.origin == "recorded" else 0) or len(sa.tokens)
                   for sa, sb in zip(va.sequences, vb.sequences, strict=True)]  # fmt: skip
    a, b = torch.cat(va.logprobs), torch.cat(vb.logprobs)
    is_generated = torch.cat([torch.arange(1, len(s.tokens)) >= p for s, p in zip(va.sequences, prompt_lens, strict=True)])
    recorded = is_generated | torch.tensor(va.prompt_recorded and vb.prompt_recorded)  # prompt tokens a side did not record: left out
    a, b, is_generated = a[recorded], b[recorded], is_generated[recorded]
    finite = torch.isfinite(a) & torch.isfinite(b)
    result: dict[str, Any] = {"comparable": True, "why": None, **_stats(a[finite], b[finite])}
    result["non_finite"] = int((~finite).sum())
    result["tokens"] = float(a.numel())
    result["prompt"] = _stats(a[finite & ~is_generated], b[finite & ~is_generated])
    result["generated"] = _stats(a[finite & is_generated], b[finite & is_generated])
    kept = va.prompt_recorded and vb.prompt_recorded
    result["prompt_recorded"] = kept
    result["sequences"] = [
        {"tokens": len(s.tokens), "prompt_len": p, **_first_differing_token(x, y, 1 if kept else p)}
        for s, p, x, y in zip(va.sequences, prompt_lens, va.logprobs, vb.logprobs, strict=True)
    ]
    result["origin"] = {"a": va.origin, "b": vb.origin}
    if result["non_finite"]:
        result["why"] = f"{result['non_finite']} log-prob(s) are NaN or Inf on a side; the figures are over the finite ones"
    return result


def _first_differing_token(a: torch.Tensor, b: torch.Tensor, first: int) -> dict[str, Any]:
    """A sequence's compared log-probs (token positions ``first`` on; ``a[i]`` is token ``i + 1``'s): bitwise, and where
    they are not, the first token position whose bits differ and its |delta|."""
    x, y = a[first - 1 :], b[first - 1 :]
    if same_bits(x, y):
        return {"bitwise": True, "first_differing_token": None}
    if x.shape != y.shape:
        return {"bitwise": False, "first_differing_token": None}
    i = int((~bit_equal(x, y)).nonzero()[0])
    return {"bitwise": False, "first_differing_token": {"position": first + i, "delta": float((x[i] - y[i]).abs())}}


def gate(logprob: dict[str, Any] | None, fail_above: float) -> str | None:
    """Why a ``--fail-above`` gate fails (None: it passes). It fails closed: no comparison, a
    non-finite value or a max |delta| above the limit all fail."""
    if logprob is None:
        return "no log-probs to compare: neither side holds logits with token ids or log-prob records"
    if not logprob.get("comparable"):
        return f"the log-prob comparison could not be made: {logprob.get('why')}"
    if logprob.get("non_finite"):
        return f"{logprob['non_finite']} log-prob(s) are NaN or Inf"
    if logprob["max"] > fail_above:
        return f"log-prob |delta| max {logprob['max']:.3g} > --fail-above {fail_above:g}"
    return None
