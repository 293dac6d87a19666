"""Log-probs as an engine's sampler returns them (fx_precision/logprobs.py) and the probe that reads which form an
engine returned (contract.probing.match_logprobs), on logits shaped as vLLM's step-0 logits calls are."""

from __future__ import annotations

import pytest
import torch

from fx_precision.contract.probing import match_logprobs
from fx_precision.contract.vocabulary import LogprobForm
from fx_precision.dump import Sequence
from fx_precision.engines.adapter import Generation
from fx_precision.logprobs import token_logprobs

VOCAB = 97


def _generation(temperature: float, form: LogprobForm, *, perturb: bool = False, top_k: int = 0, top_p: float = 1.0) -> Generation:
    """Two prompts prefilled in step 0 (one logits row each: the last prompt row), a token sampled from each, the
    log-probs of every token as an engine in ``form`` returns them (prompt tokens raw)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [[5, 9, 11, 2], [7, 1, 3, 8, 4, 6]]
    logits = (torch.randn(len(prompts), VOCAB, generator=gen) * 3).to(torch.bfloat16)
    sequences, logprobs = [], []
    for i, prompt in enumerate(prompts):
        sampled = int(torch.argmax(logits[i].float()))
        tokens = (*prompt, sampled)
        full = torch.randn(1, len(tokens), VOCAB, generator=gen).to(torch.bfloat16)
        full[0, len(prompt) - 1] = logits[i]  # the row that sampled the last token
        lp = token_logprobs(full, torch.tensor([tokens]), form, temperature, [len(prompt)], top_k, top_p)[0]
        if perturb:
            lp[-1] = torch.nextafter(lp[-1], torch.tensor(0.0))
        sequences.append(Sequence(tokens, len(prompt)))
        logprobs.append(lp)
    steps = [[(p, t) for prompt in prompts for p, t in enumerate(prompt)]]
    return Generation(sequences, logprobs, steps, [(0, 2)], 0.0, sampled_logits=(0, (logits,)), temperature=temperature, top_k=top_k,
                      top_p=top_p)  # fmt: skip


@pytest.mark.parametrize("form", [LogprobForm.RAW, LogprobForm.PROCESSED])
def test_the_probe_reads_which_log_probs_the_engine_returned_at_a_temperature(form: LogprobForm) -> None:
    kept, evidence = match_logprobs(_generation(0.7, form))
    assert kept is form and evidence.kept == str(form), evidence
    assert evidence.rows_given[str(form)] == 2 and evidence.rows_given[str(LogprobForm.RAW if form is LogprobForm.PROCESSED
                                                                              else LogprobForm.PROCESSED)] == 0  # fmt: skip


def test_log_probs_no_form_gives_are_unmatched_not_defaulted() -> None:
    kept, evidence = match_logprobs(_generation(0.7, LogprobForm.PROCESSED, perturb=True))
    assert kept is None and "no candidate" in str(evidence.why)


def test_at_temperature_one_both_forms_are_one_computation() -> None:
    kept, evidence = match_logprobs(_generation(1.0, LogprobForm.PROCESSED))
    assert kept is LogprobForm.RAW and evidence.kept == "raw"


def test_processed_log_probs_leave_prompt_positions_raw() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, VOCAB, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 6), generator=gen)
    raw = token_logprobs(logits, ids)
    processed = token_logprobs(logits, ids, LogprobForm.PROCESSED, 0.5, [4])
    assert torch.equal(processed[:, :3], raw[:, :3])  # tokens 1..3 are the prompt's
    expected = torch.log_softmax(logits[0, 3:5].float() / 0.5, -1).gather(-1, ids[0, 4:6, None]).squeeze(-1)
    assert torch.equal(processed[0, 3:], expected) and not torch.equal(processed[0, 3:], raw[0, 3:])


def _kept_by_definition(row: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, from the definition in exact arithmetic: the k largest (with ties), then in
    ascending order every token whose cumulative probability (over what top-k kept) is at most 1 - p is dropped, the
    largest always kept."""
    import math

    scaled = [v / temperature for v in row]
    order = sorted(range(len(row)), key=lambda i: scaled[i])
    kth = sorted(scaled, reverse=True)[top_k - 1] if top_k else -math.inf
    kept = [i for i in order if scaled[i] >= kth]
    total = sum(math.exp(scaled[i]) for i in kept)
    running, out = 0.0, set()
    for n, i in enumerate(kept):
        running += math.exp(scaled[i]) / total
        if running > 1 - top_p or n == len(kept) - 1:
            out.add(i)
    return out


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.7), (9, 0.5), (0, 1e-6)])
def test_processed_log_probs_are_renormalised_over_what_top_k_and_top_p_keep(top_k: int, top_p: float) -> None:
    """The processed form with top-k / top-p: every token the sampler drops is -inf, the kept ones are the softmax
    at the temperature over the kept set alone (the definition, in fp64), and each row depends on itself only."""
    from fx_precision.logprobs import processed_logprobs

    x = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7)) * 2
    out = processed_logprobs(x, 0.7, top_k, top_p)
    for r in range(x.shape[0]):
        kept = _kept_by_definition(x[r].tolist(), 0.7, top_k, top_p)
        assert {i for i in range(VOCAB) if out[r, i] > -float("inf")} == kept
        want = torch.log_softmax(x[r, sorted(kept)].double() / 0.7, -1)
        torch.testing.assert_close(out[r, sorted(kept)].double(), want, rtol=0, atol=1e-5)
        assert torch.equal(processed_logprobs(x[r : r + 1], 0.7, top_k, top_p)[0], out[r])  # alone, the same bits
    assert top_p > 1e-3 or (out > -float("inf")).sum(-1).eq(1).all()  # a tiny p keeps the most likely token only


def test_top_k_and_top_p_enter_the_processed_form_only_and_the_probe_reads_them() -> None:
    """Raw log-probs ignore the sampler's top-k / top-p; the processed ones at T = 1 differ from raw once they mask;
    the probe, told the request's top-k / top-p, reads the processed form an engine returned with them."""
    logits = torch.randn(1, 6, VOCAB, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    ids[0, 1:] = logits[0, :-1].float().argmax(-1)  # sampled tokens the mask keeps
    raw = token_logprobs(logits, ids, LogprobForm.RAW, 1.0, [1], top_k=5, top_p=0.5)
    assert torch.equal(raw, token_logprobs(logits, ids))
    masked = token_logprobs(logits, ids, LogprobForm.PROCESSED, 1.0, [1], top_k=5, top_p=0.5)
    assert (masked > raw).all()  # renormalised over fewer tokens
    for temperature in (0.7, 1.0):  # at T = 1 too: the mask alone parts the forms
        found, evidence = match_logprobs(_generation(temperature, LogprobForm.PROCESSED, top_k=5, top_p=0.5))
        assert found is LogprobForm.PROCESSED and evidence.rows_given["raw"] == 0, evidence
    generation = _generation(0.7, LogprobForm.PROCESSED)
    generation.top_k, generation.top_p = 5, 0.5  # the engine sampled with them, the log-probs did not: no form gives them
    form, evidence = match_logprobs(generation)
    assert form is None and evidence.rows_given["processed"] == 0, evidence
