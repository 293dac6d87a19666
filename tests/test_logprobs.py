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


def _generation(temperature: float, form: LogprobForm, *, perturb: bool = False) -> Generation:
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
        lp = token_logprobs(full, torch.tensor([tokens]), form, temperature, [len(prompt)])[0]
        if perturb:
            lp[-1] = torch.nextafter(lp[-1], torch.tensor(0.0))
        sequences.append(Sequence(tokens, len(prompt)))
        logprobs.append(lp)
    steps = [[(p, t) for prompt in prompts for p, t in enumerate(prompt)]]
    return Generation(sequences, logprobs, steps, [(0, 2)], 0.0, sampled_logits=(0, (logits,)), temperature=temperature)


@pytest.mark.parametrize("form", [LogprobForm.RAW, LogprobForm.PROCESSED])
def test_the_probe_reads_which_log_probs_the_engine_returned_at_a_temperature(form: LogprobForm) -> None:
    kept, evidence = match_logprobs(_generation(0.7, form))
    assert kept is form and evidence["kept"] == str(form), evidence
    assert evidence["rows given"][str(form)] == 2 and evidence["rows given"][str(LogprobForm.RAW if form is LogprobForm.PROCESSED
                                                                              else LogprobForm.PROCESSED)] == 0  # fmt: skip


def test_log_probs_no_form_gives_are_unmatched_not_defaulted() -> None:
    kept, evidence = match_logprobs(_generation(0.7, LogprobForm.PROCESSED, perturb=True))
    assert kept is None and "no candidate" in evidence["why"]


def test_at_temperature_one_both_forms_are_one_computation() -> None:
    kept, evidence = match_logprobs(_generation(1.0, LogprobForm.PROCESSED))
    assert kept is LogprobForm.RAW and evidence["kept"] == "raw"


def test_processed_log_probs_leave_prompt_positions_raw() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, VOCAB, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 6), generator=gen)
    raw = token_logprobs(logits, ids)
    processed = token_logprobs(logits, ids, LogprobForm.PROCESSED, 0.5, [4])
    assert torch.equal(processed[:, :3], raw[:, :3])  # tokens 1..3 are the prompt's
    expected = torch.log_softmax(logits[0, 3:5].float() / 0.5, -1).gather(-1, ids[0, 4:6, None]).squeeze(-1)
    assert torch.equal(processed[0, 3:], expected) and not torch.equal(processed[0, 3:], raw[0, 3:])
