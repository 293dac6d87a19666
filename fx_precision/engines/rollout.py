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
from typing import TYPE_CHECKING

from fx_precision.contract import EngineContract
from fx_precision.dump import Dump
from fx_precision.engine_description import EngineDescription
from fx_precision.engines import engine_adapter
from fx_precision.engines.adapter import Generation, ModulePass, RolloutConfig, SamplingRequest
from fx_precision.engines.preflight import engine_preflight
from fx_precision.engines.prompts import read_prompts, synthetic_prompts

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _architecture(config: object) -> str:
    names = getattr(config, "architectures", None) or []
    return str(names[0]) if names else type(config).__name__.replace("Config", "ForCausalLM")


def rollout_prompts(model: str, prompts_file: str | None, lengths: Sequence[int], seed: int, max_tokens: int, engine: str,
                    isa: str = "auto") -> tuple[tuple[int, ...], ...]:  # fmt: skip
    """The prompts of a rollout (a file's, or synthetic ones of ``lengths``), checked by the engine preflight
    (engines/preflight.py) before the engine starts."""
    checked = engine_preflight(model, engine, isa)
    prompts = read_prompts(prompts_file) if prompts_file else synthetic_prompts(checked.vocab, lengths, seed)
    checked.check_prompts(prompts, max_tokens)
    return prompts


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


def engine_dump(config: PretrainedConfig, info: EngineDescription, generation: Generation, module_pass: ModulePass | None,
                contract: EngineContract | None, seed: int, samples: int) -> Dump:  # fmt: skip
    """One generation as an engine dump: its sequences and log-prob records, the module records of ``module_pass``,
    ``engine`` (how it ran: ``info``, its steps and logits calls, the module pass's) and ``contract``."""
    dump = Dump(_architecture(config), inputs=module_pass is not None, source=info.label())
    dump.engine = {
        **info.to_dict(),
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
