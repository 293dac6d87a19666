"""A rollout: any live engine's adapter, run into a dump.

run_rollout(cfg)
├── start        engine_adapter(cfg.engine).start(cfg)                  (the engine in this process)
├── generate     the prompts, sampled with log-probs of every token     (Generation)
├── modules      with cfg.modules: each sequence prefilled alone, every module recorded (ModulePass)
├── probe        every op class of the contract, at the run's shapes, rows, lengths and threads
└── dump         sequences and log-prob records, module records, ``engine`` (how it ran, its steps and logits
                 calls, the module pass's), ``contract``
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fx_precision.checkpoints import check_weights_fit_config, read_checkpoint_config
from fx_precision.contract import EngineContract
from fx_precision.dump import Dump
from fx_precision.engines import engine_adapter
from fx_precision.engines.adapter import Generation, ModulePass, RolloutConfig, SamplingRequest
from fx_precision.engines.prompts import check_prompts, read_prompts, synthetic_prompts
from fx_precision.errors import PrecisionError

MAX_POSITIONS = 8192  # what an engine here is started with at most (engines.vllm.session.MAX_MODEL_LEN; its KV cache is sized for it)


def _architecture(config: object) -> str:
    names = getattr(config, "architectures", None) or []
    return str(names[0]) if names else type(config).__name__.replace("Config", "ForCausalLM")


def rollout_prompts(model: str, prompts_file: str | None, lengths: Sequence[int], seed: int, max_tokens: int, engine: str,
                    isa: str = "auto") -> tuple[tuple[int, ...], ...]:  # fmt: skip
    """The prompts of a rollout (a file's, or synthetic ones of ``lengths``), checked against the checkpoint and the engine
    before it starts: the engine runs the checkpoint's architecture (``refuses``), its weights are its config's, ids in
    the vocabulary, lengths the engine survives as the CPU family it runs as (``min_prompt_tokens``), prompt plus sampled tokens within its
    positions."""
    cc = read_checkpoint_config(model)
    adapter = engine_adapter(engine)
    refused = adapter.refuses(cc.config)
    if refused:
        raise PrecisionError(f"--model {model}: {refused}")
    check_weights_fit_config(cc)
    vocab = int(cc.config.vocab_size)
    prompts = read_prompts(prompts_file) if prompts_file else synthetic_prompts(vocab, lengths, seed)
    positions = min(int(getattr(cc.config, "max_position_embeddings", 2048) or 2048), MAX_POSITIONS)
    check_prompts(prompts, vocab, positions, max_tokens, model, min_len=min_prompt_tokens(adapter, isa))
    return prompts


def min_prompt_tokens(adapter: Any, isa: str = "auto") -> int:
    """The shortest prompt ``adapter``'s engine survives (1 where it says nothing)."""
    found = getattr(adapter, "min_prompt_tokens", None)
    return int(found(isa)) if callable(found) else 1


def run_rollout(cfg: RolloutConfig) -> Dump:
    """Start the engine, generate with log-probs, optionally record module outputs, probe its arithmetic (module docstring)."""
    session = engine_adapter(cfg.engine).start(cfg)
    try:
        generation = session.generate(SamplingRequest(cfg.prompts, cfg.max_tokens, cfg.temperature, cfg.samples, bool(cfg.prompt_logprobs),
                                                      cfg.top_k, cfg.top_p))  # fmt: skip
        module_pass = session.record_modules(generation.sequences, cfg.temperature) if cfg.modules else None
        contract = session.probe(generation, module_pass)
        return engine_dump(session.config, session.describe(), generation, module_pass, contract, cfg.seed, cfg.samples)
    finally:
        session.close()


def engine_dump(config: Any, info: dict[str, Any], generation: Generation, module_pass: ModulePass | None, contract: EngineContract | None,
                seed: int, samples: int) -> Dump:  # fmt: skip
    """One generation as an engine dump: its sequences and log-prob records, the module records of ``module_pass``,
    ``engine`` (how it ran: ``info``, its steps and logits calls, the module pass's) and ``contract``."""
    dump = Dump(
        _architecture(config), inputs=module_pass is not None, source=f"{info['name']} {info['version']} ({info.get('kernels', '')})"
    )
    dump.engine = {
        **info,
        "generate_seconds": round(generation.seconds, 3),
        "temperature": generation.temperature,
        "top_k": generation.top_k,  # the sampler's top-k and top-p (0 and 1: off); processed log-probs are renormalised over them
        "top_p": generation.top_p,
        "seed": seed,
        "samples": samples,
        "steps": generation.steps,  # each forward's rows: [position, token]
        "logits_calls": generation.logits_calls,  # [step, rows] of each logits computation
        "module_steps": module_pass.steps if module_pass else [],  # the module pass's forwards (each sequence alone)
        "module_logits_calls": module_pass.logits_calls if module_pass else [],
        **generation.extra,
    }
    for sequence, logprobs in zip(generation.sequences, generation.logprobs, strict=True):
        dump.add_logprobs(sequence, logprobs)
    if module_pass is not None:
        dump.records.extend(module_pass.records)
        dump.calls.extend(module_pass.calls)
    dump.contract = contract.to_dict() if contract is not None else None
    return dump
