"""Each sample's own prompt log-probs: vLLM computes them per sample and returns one sample's for all.

With ``SamplingParams(n=G, prompt_logprobs=0)`` vLLM (v1) runs G child requests, and each child computes the log-probs
of the whole prompt in its own steps: its own logits calls and, with chunked prefill, its own attention work among
the other requests of each step. ``LLM.generate`` (``RequestOutputKind.FINAL_ONLY``) then returns one
``RequestOutput`` per prompt, whose ``prompt_logprobs`` are those of the child that finished last (the one whose
output completed the parent's aggregate). Where the children's steps differ (a prompt prefilled beside another
sample's, or cut across steps by the token budget), so can their bits, and attributing that one child's log-probs to
every sample compares G - 1 samples with rows another request computed::

    ChildPromptLogprobs()            while the engine generates: RequestState.make_request_output wrapped (it calls
    │                                the original and returns what it returns), and where a child finishes, its
    │                                own prompt log-probs kept, keyed by (parent request id, sample index)
    └── of(output, sample)           the prompt log-probs of sample ``sample.index`` of ``output`` (vLLM's entries:
                                     None for the first token, then {token: Logprob})

It observes the engine's output processing and changes nothing in it (no arithmetic, no scheduling).
"""

from __future__ import annotations

from typing import Any

from fx_precision.errors import PrecisionError

_WRAPPED = "vllm.v1.engine.output_processor.RequestState.make_request_output"


class ChildPromptLogprobs:
    """Per sample, the prompt log-probs its own child request computed (see the module docstring); ``wanted`` False
    (no prompt log-probs asked for): nothing wrapped."""

    def __init__(self, wanted: bool = True) -> None:
        self.wanted = wanted
        self.kept: dict[tuple[str, int], list[Any]] = {}
        self._state: Any = None
        self._original: Any = None

    def __enter__(self) -> ChildPromptLogprobs:
        if not self.wanted:
            return self
        try:
            from vllm.v1.engine.output_processor import RequestState
        except ImportError:
            return self  # nothing kept: of() takes a lone sample's from its output, and refuses G > 1
        original = getattr(RequestState, "make_request_output", None)
        if original is None:
            return self
        kept = self.kept

        def make_request_output(state: Any, *args: Any, **kwargs: Any) -> Any:
            finish_reason = kwargs.get("finish_reason", args[2] if len(args) > 2 else None)
            processor = getattr(state, "logprobs_processor", None)
            if finish_reason is not None and processor is not None and processor.prompt_logprobs is not None:
                parent = state.parent_req
                request = parent.external_req_id if parent is not None else state.external_req_id
                kept[(str(request), int(state.request_index))] = list(processor.prompt_logprobs)
            return original(state, *args, **kwargs)

        self._state, self._original = RequestState, original
        RequestState.make_request_output = make_request_output
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state is not None:
            self._state.make_request_output = self._original
            self._state = self._original = None

    def of(self, output: Any, sample: Any) -> list[Any]:
        """The prompt log-probs sample ``sample`` (a ``CompletionOutput`` of ``output``) computed itself: those kept as it
        finished, or a lone sample's from its output (the only child's); refused where G samples left none kept."""
        key = (str(output.request_id), int(sample.index))
        if key in self.kept:
            return self.kept[key]
        if len(output.outputs) == 1 and output.prompt_logprobs is not None:
            return list(output.prompt_logprobs)
        raise PrecisionError(
            f"vLLM returned one sample's prompt log-probs for the {len(output.outputs)} samples of request {key[0]}, and this vLLM "
            f"kept no sample's own ({_WRAPPED} not seen); ask for one sample (--samples 1) or roll out without --prompt-logprobs"
        )
