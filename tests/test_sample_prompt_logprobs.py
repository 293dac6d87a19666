"""Each sample's own prompt log-probs (fx_precision/engines/vllm/sample_prompt_logprobs.py), where no child's was kept.

vLLM returns one sample's prompt log-probs for all G samples of a prompt; the rollout keeps each child's own as it
finishes. Where none was kept (a vLLM without the output processor the rollout reads: here, none is installed),
a lone sample's are its output's (the only child computed them) and G samples are refused in one line, never
given one sample's log-probs each. The kept path runs against the real engine in tests/engine/test_launch_defaults.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fx_precision.engines.vllm.sample_prompt_logprobs import ChildPromptLogprobs
from fx_precision.errors import PrecisionError

PROMPT_LOGPROBS = [None, {5: -1.25}, {7: -0.5}]


def output(samples: int) -> SimpleNamespace:  # a RequestOutput's fields the rollout reads (vLLM is not installed here)
    return SimpleNamespace(request_id="0", prompt_logprobs=PROMPT_LOGPROBS, outputs=[SimpleNamespace(index=i) for i in range(samples)])


def test_a_lone_samples_prompt_logprobs_are_its_outputs() -> None:
    with ChildPromptLogprobs() as own:
        pass
    out = output(1)
    assert own.of(out, out.outputs[0]) == PROMPT_LOGPROBS


def test_g_samples_with_no_childs_own_kept_are_refused_in_one_line() -> None:
    with ChildPromptLogprobs() as own:
        pass
    out = output(4)
    with pytest.raises(PrecisionError) as raised:
        own.of(out, out.outputs[2])
    message = str(raised.value)
    assert "\n" not in message and "4 samples" in message and "--samples 1" in message, message


def test_kept_prompt_logprobs_are_each_samples_own() -> None:
    own = ChildPromptLogprobs(wanted=False)
    with own:
        own.kept[("0", 2)] = [None, {5: -3.0}, {7: -0.25}]
    out = output(4)
    assert own.of(out, out.outputs[2]) == [None, {5: -3.0}, {7: -0.25}]
