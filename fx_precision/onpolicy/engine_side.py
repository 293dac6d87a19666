"""Rank 0's engine in the on-policy loop: a live engine in its own process, the weights it runs, step 0's contract.

EngineSide(cfg, python, root, vocab)    the engine started on the run's checkpoint (engines/client.EngineProcess),
│                                       the positions the run needs, processed log-probs, split-KV off, launched
│                                       eager or at its defaults (--engine-launch)
├── sync(weights) -> digest             the trainer's bf16 weights loaded in place; the engine's digest of what it
│                                       loaded must be the trainer's
├── fixed_logprobs() -> digest          one fixed sequence's prompt log-probs: they change when the weights do
├── rollout(prompts, step) -> StepData  P prompts x G samples in one engine call
├── contract(step)                      the contract of that generation: every op class matched, the graph-fixed
│                                       ones those of step 0 (the trainer's graphs were compiled to them)
├── record(run_dir, step, modules)      the step's checkpoint and rollout dump, written whole into DIR
└── close()                             the engine stopped, its weights file removed
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fx_precision.engines.adapter import Generation, SamplingRequest
from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.batches import StepData
from fx_precision.onpolicy.config import FIXED_PROMPT_LEN, OnPolicyConfig

if TYPE_CHECKING:
    from fx_precision.contract import EngineContract
    from fx_precision.onpolicy.run_dir import RunDir


class EngineSide:
    """Rank 0's engine (module docstring)."""

    def __init__(self, cfg: OnPolicyConfig, python: str, root: Path, vocab: int) -> None:
        from fx_precision.engines.adapter import RolloutConfig
        from fx_precision.engines.client import EngineProcess, EngineTimeouts
        from fx_precision.engines.prompts import synthetic_prompts

        self.cfg = cfg
        self.fixed = synthetic_prompts(vocab, (FIXED_PROMPT_LEN,), 7)  # the same sequence every step
        sampling, engine = cfg.sampling, cfg.engine
        rollout = RolloutConfig(
            model=cfg.checkpoint, prompts=sampling.step_prompts(vocab, 0), engine=engine.name, max_tokens=sampling.max_tokens,
            seed=sampling.seed, temperature=sampling.temperature, samples=sampling.samples, threads=engine.threads,
            logprobs="processed", split_kv="off" if engine.eager else "default", max_model_len=sampling.engine_positions(),
            launch=engine.launch, prompt_logprobs=engine.eager,
        )  # fmt: skip
        self.process = EngineProcess(python, rollout, root / "engine.log", EngineTimeouts(float(cfg.engine.timeout)))
        self.weights: dict[str, torch.Tensor] = {}
        self.first_contract: EngineContract | None = None
        self._last: Generation | None = None

    def sync(self, weights: dict[str, torch.Tensor]) -> str:
        """The engine loads ``weights`` in place; its digest of them must be theirs."""
        from fx_precision.checkpoints import tensors_digest

        digest = self.process.load_weights(weights.items())
        sent = tensors_digest(weights.items())
        if digest != sent:
            raise PrecisionError(
                f"weight sync: the engine loaded {digest}, the trainer sent {sent}; the engine does not run the trainer's weights"
            )
        self.weights = weights
        return digest

    def fixed_logprobs(self) -> str:
        """A digest of the fixed sequence's prompt log-probs under the engine's current weights."""
        generation = self.process.generate(SamplingRequest(self.fixed, 1, 1.0, 1))
        return hashlib.sha256(generation.logprobs[0][: FIXED_PROMPT_LEN - 1].numpy().tobytes()).hexdigest()[:16]

    def rollout(self, prompts: tuple[tuple[int, ...], ...], step: int) -> StepData:
        cfg = self.cfg
        prompt_logprobs = cfg.engine.eager  # at the engine's defaults none: as users sample
        request = SamplingRequest(
            prompts,
            cfg.sampling.max_tokens,
            cfg.sampling.temperature,
            cfg.sampling.samples,
            prompt_logprobs,
            top_k=cfg.sampling.top_k,
            top_p=cfg.sampling.top_p,
        )
        self._last = self.process.generate(request)
        g = self._last
        routes: dict[str, object] | None = {k: g.extra[k] for k in ("moe", "routes", "routes_missing") if k in g.extra} or None
        return StepData(g.sequences, g.logprobs, g.steps, g.logits_calls, routes=routes)

    def contract(self, step: int) -> EngineContract:
        """This generation's contract: every op class matched, and the graph-fixed ones (norm, rotary, attention,
        log-probs, eager math, experts) those of step 0, whose contract the trainer's graphs were compiled to."""
        if self._last is None:
            raise PrecisionError(f"step {step}: the engine's contract is read off a rollout, and none ran yet")
        contract = self.process.probe(self._last)
        if contract.unmatched:
            op_class, why = contract.unmatched[0]
            raise PrecisionError(
                f"step {step}: the engine's {op_class} matched no candidate the contract knows ({why}); the trainer cannot compute "
                "what the engine does: run with --contract none to see the gap"
                + (" (--replay-routes routes every token to the engine's experts)" if str(op_class) == "moe" else "")
            )
        if self.first_contract is None:
            self.first_contract = contract
        else:
            for name in ("norm", "rotary", "attention", "logprobs", "eager_math", "moe", "inductor", "norm_reductions"):
                if getattr(contract, name) != getattr(self.first_contract, name):
                    raise PrecisionError(
                        f"step {step}: the engine's {name} is {getattr(contract, name)}, at step 0 {getattr(self.first_contract, name)}: "
                        "the engine changed its arithmetic mid-run; restart the run"
                    )
        return contract

    def record(self, run_dir: RunDir, step: int, modules: bool = False) -> None:
        """DIR/steps/NNNN: the checkpoint the engine ran (the synced weights + config) and the engine's dump of this step's
        rollout (``modules``: with every module's inputs and outputs, for the comparator's first origin; the contract
        where the run follows it); ``last`` moved to it. Nothing half-written is left."""
        staging = run_dir.staging(step)
        try:
            run_dir.write_checkpoint(staging, self.weights, self.cfg.checkpoint)
            sampling = self.cfg.sampling
            self.process.dump_last(str(staging / "rollout"), modules=modules, seed=sampling.seed, samples=sampling.samples,
                                   probe=self.cfg.training.contract == "vllm")  # fmt: skip
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # DIR keeps the last complete step
            raise
        run_dir.commit(step, staging)

    def close(self) -> None:
        self.process.close()
