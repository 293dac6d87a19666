"""What an engine adapter is: the one place an engine's knowledge lives.

EngineAdapter                       one per engine (registered in fx_precision/engines/__init__.py)
├── name                            "vllm", "sglang", ...
├── start(cfg) -> EngineSession     a live engine on a checkpoint (live engines only)
└── read_dump(path) -> Dump         an engine's own dump files as a dump (read-only adapters)
EngineSession                       one interface, in this process (an adapter's session) or in its own
│                                   (engines/client.EngineProcess over engines/protocol.py)
├── generate(SamplingRequest) -> Generation   sampled tokens, the log-prob of every prompt and sampled token,
│                                             the engine's steps (rows of each forward) and logits calls
├── probe(generation, module_pass) -> EngineContract   the op classes read off the engine's own ops, at that
│                                             generation's calls (contract/probing.py); out of process: the last one
├── load_weights(named tensors) -> digest     the trainer's bf16 weights, in place (the on-policy loop's sync); the
│                                             tensors_digest of what the engine now runs
├── describe() -> EngineDescription          how it runs: version, build, ISA, threads, ... (the dump's ``engine``)
└── close()
LocalSession(EngineSession)         an adapter's session in this process, also
└── record_modules(sequences) -> ModulePass   each sequence prefilled alone, every module's inputs and outputs
                                              under transformers FQNs, and that pass's steps
RolloutConfig                       what a rollout asks of any engine (knobs an engine lacks are refused by it)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fx_precision.contract import EngineContract
from fx_precision.dump import CallInfo, Dump, Record
from fx_precision.dump import Sequence as TokenSequence
from fx_precision.engine_description import EngineDescription
from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LAUNCHES = ("defaults", "eager")
DEFAULT_LAUNCH = "defaults"  # the engine as its users launch it: the CLI's --launch default and RolloutConfig's, one value
COMPILED_MODULES = (
    "vLLM compiles its model at its defaults, and module hooks do not run inside the compiled graph: the dump would hold no "
    "module's inputs or outputs; record modules against the eager engine (--launch eager)"
)


@dataclass(frozen=True)
class RolloutConfig:
    model: str  # checkpoint directory
    prompts: tuple[tuple[int, ...], ...]
    engine: str = "vllm"
    max_tokens: int = 8
    seed: int = 1  # the engine's generator, seeded once (and the CLI's synthetic prompts): rollout --seed's default
    temperature: float = 1.0
    samples: int = 1  # samples of each prompt (GRPO's group)
    top_k: int = 0  # the sampler keeps the k most likely tokens (0: all)
    top_p: float = 1.0  # ... and the fewest whose probabilities sum past p (1: all)
    modules: bool = False
    threads: int = 0  # the engine's OpenMP threads; 0: the launch's own (1 eager, the machine's cores at the defaults)
    custom_ops: str = "default"  # vLLM: "default" (its choice: the C++ rotary on CPU) | "none" (native torch forms)
    split_kv: str = "default"  # vLLM: "default" (the environment's VLLM_CPU_ATTN_SPLIT_KV: on) | "on" | "off"
    isa: str = "auto"  # vLLM: "auto" (what it picks on this machine) | "avx2" | "avx512" (another kernel build)
    logprobs: str = "raw"  # "raw" (of the logits as they are) | "processed" (of the logits at the temperature)
    launch: str = DEFAULT_LAUNCH  # vLLM: "defaults" (as users launch it: compile on, prefix caching, chunked prefill) | "eager"
    prompt_logprobs: bool | None = None  # the prompt tokens' log-probs too; None: the launch's own (eager yes, defaults no:
    # users sample without them)
    max_model_len: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Checks the sampling and the launch, and settles what the launch decides where it was left to it (``threads``
        0, ``prompt_logprobs`` None), so the CLI and the Python API run one engine for one request."""
        if self.launch not in LAUNCHES:
            raise PrecisionError(f"--launch {self.launch!r}: one of {', '.join(LAUNCHES)}")
        check_sampling(self.temperature, self.samples, self.top_k, self.top_p)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise PrecisionError(f"--threads {self.threads!r}: a count of threads, 0 for the launch's own")
        if self.threads == 0:
            object.__setattr__(self, "threads", 1 if self.launch == "eager" else os.cpu_count() or 1)
        if self.prompt_logprobs is None:
            object.__setattr__(self, "prompt_logprobs", self.launch == "eager")
        if self.modules and self.launch == "defaults":
            raise PrecisionError(f"--modules with --launch defaults: {COMPILED_MODULES}")


def check_sampling(temperature: float, samples: int, top_k: int = 0, top_p: float = 1.0) -> None:
    """Greedy sampling (temperature 0) draws one answer per prompt: several samples of it are one sample repeated, and
    top-k or top-p change nothing of it; top-k is a count (0: off), top-p a share in (0, 1] (1: off)."""
    if float(temperature) == 0.0 and samples > 1:
        raise PrecisionError(
            f"--temperature 0 is greedy: it draws one answer per prompt, so --samples {samples} would repeat it; use --samples 1, "
            "or a temperature above 0"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise PrecisionError(f"--top-k {top_k!r}: a count of tokens, 0 for all")
    if not 0.0 < float(top_p) <= 1.0:
        raise PrecisionError(f"--top-p {top_p!r}: a share of the probability in (0, 1], 1 for all")
    if float(temperature) == 0.0 and (top_k > 0 or top_p < 1.0):
        raise PrecisionError("--temperature 0 is greedy: it draws the most likely token, so --top-k and --top-p change nothing; "
                             "drop them, or sample at a temperature above 0")  # fmt: skip


@dataclass(frozen=True)
class SamplingRequest:
    """One engine call: P prompts, each sampled ``samples`` times (GRPO's group), ``max_tokens`` each, from the engine's
    own generator (seeded once, when it starts: ``RolloutConfig.seed``), as users sample: no per-request seed."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    temperature: float = 1.0
    samples: int = 1
    prompt_logprobs: bool = True  # the log-probs of the prompt tokens too (they add logits calls to the engine's steps)
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.samples, self.top_k, self.top_p)


@dataclass
class Generation:
    """What one engine call produced: a sequence per sample (prompt + sampled tokens) with the log-prob of every token
    but the first, the rows of each engine forward (position, token) and each logits computation (step, rows)."""

    sequences: list[TokenSequence]
    logprobs: list[torch.Tensor]
    steps: list[list[tuple[int, int]]]
    logits_calls: list[tuple[int, int]]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific observations (how it called its norms, ...)
    sampled_logits: tuple[int, tuple[torch.Tensor, ...]] | None = None  # (step, its logits calls): the log-prob probe's evidence
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class ModulePass:
    """Every module's inputs and outputs of each sequence prefilled alone (call i = sequence i), under transformers
    FQNs and paths, and the forwards that pass ran."""

    records: list[Record]
    calls: list[CallInfo]
    steps: list[list[tuple[int, int]]]
    logits_calls: list[tuple[int, int]]


class EngineSession(Protocol):
    def generate(self, request: SamplingRequest) -> Generation: ...

    def probe(self, generation: Generation, module_pass: ModulePass | None = None) -> EngineContract: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str: ...

    def describe(self) -> EngineDescription: ...

    def close(self) -> None: ...


class LocalSession(EngineSession, Protocol):
    config: PretrainedConfig  # the checkpoint's config

    def record_modules(self, sequences: Sequence[TokenSequence], temperature: float) -> ModulePass: ...


class EngineAdapter(Protocol):
    name: str
    live: bool  # a rollout can start it here (else: its dump files are read)

    def refuses(self, config: PretrainedConfig) -> str | None: ...  # why it cannot run a checkpoint of this config, before it starts

    def min_prompt_tokens(self, isa: str = "auto") -> int: ...  # the shortest prompt it survives as the CPU family ``isa``

    def recognizes(self, path: str) -> bool: ...  # ``path`` holds this engine's own dump files (read_dump reads them)

    def start(self, cfg: RolloutConfig) -> LocalSession: ...

    def read_dump(self, path: str) -> Dump: ...
