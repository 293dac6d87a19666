"""One engine preflight: what is refused before an engine starts, for the rollout, the engine server and the loop.

    engine_preflight(model, engine, isa, ...) -> EnginePreflight
    ├── the adapter          a registered engine (live where a run must start it)
    ├── refuses(config)      the engine cannot run this architecture, or the contract cannot follow it
    ├── the weights          the config's (names, shapes); finite where asked (a policy to train from)
    └── EnginePreflight      the config, its vocabulary, the positions the engine is started with, the shortest
                             prompt the engine survives as the CPU family it runs as
    EnginePreflight.check_prompts(prompts, max_tokens)     ids in the vocabulary, at least the shortest length,
                                                           prompt plus sampled tokens within the positions
    EnginePreflight.check_prompt_lens(lens)                synthetic prompts' lengths, the same shortest length

``fx-precision rollout`` (engines/rollout.rollout_prompts), the engine server's start (engines/serve.py) and the
on-policy loop's parent (onpolicy/loop.preflight, which adds what only training refuses) call it: one set of
refusals, one wording.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fx_precision.checkpoints import CheckpointConfig, check_weights_fit_config, non_finite_tensors, read_checkpoint_config
from fx_precision.engines import engine_adapter
from fx_precision.engines.adapter import EngineAdapter
from fx_precision.engines.prompts import check_prompts
from fx_precision.errors import PrecisionError

MAX_POSITIONS = 8192  # what an engine here is started with at most (engines.vllm.session.MAX_MODEL_LEN; its KV cache is sized for it)


@dataclass(frozen=True)
class EnginePreflight:
    """A checkpoint an engine was checked to run (engine_preflight), and what the prompts of its runs must respect."""

    model: str
    checkpoint: CheckpointConfig
    adapter: EngineAdapter
    vocab: int
    positions: int  # the engine's positions: the config's, at most MAX_POSITIONS
    min_prompt_len: int  # the shortest prompt the engine survives as the CPU family it runs as

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        check_prompts(prompts, self.vocab, self.positions, max_tokens, self.model, min_len=self.min_prompt_len)

    def check_prompt_lens(self, lens: Sequence[int]) -> None:
        short = [n for n in lens if n < self.min_prompt_len]
        if short:
            raise PrecisionError(
                f"--prompt-lens {short[0]}: this engine build needs prompts of at least {self.min_prompt_len} tokens (its CPU "
                "attention stops on shorter ones)"
            )


def engine_preflight(model: str, engine: str, isa: str = "auto", *, live: bool = False, finite: bool = False) -> EnginePreflight:
    """The checks every engine launch makes before it starts (module docstring); ``live``: the caller starts the engine
    itself (an adapter that reads dump files is refused), ``finite``: the weights are a policy to train (NaN or Inf
    refused; a rollout of them runs, and its dump says the log-probs are not usable)."""
    cc = read_checkpoint_config(model)
    adapter = engine_adapter(engine)
    if live and not adapter.live:
        raise PrecisionError(
            f"engine {engine!r}: that adapter reads an engine's dump files, it cannot start the engine; a run that starts one "
            "needs a live engine: engine='vllm'"
        )
    refused = adapter.refuses(cc.config)
    if refused:
        raise PrecisionError(f"--model {model}: {refused}")
    check_weights_fit_config(cc)
    if finite:
        bad = non_finite_tensors(model)
        if bad:
            name, count, total = bad[0]
            raise PrecisionError(
                f"--model {model}: {name} holds {count} NaN or Inf value(s) of {total} ({len(bad)} tensor(s) in all): a policy "
                "with non-finite weights samples garbage and learns nothing; start from a finite checkpoint"
            )
    positions = min(int(getattr(cc.config, "max_position_embeddings", 2048) or 2048), MAX_POSITIONS)
    return EnginePreflight(model, cc, adapter, int(cc.config.vocab_size), positions, adapter.min_prompt_tokens(isa))
