"""One on-policy run's configuration in sections, each checked field by field when it is made (one line naming the flag and
the fix), the run's own fields and what crosses sections checked by the run:

    OnPolicyConfig(checkpoint, out, steps, mode, modules, overwrite)     the run
    ├── sampling: Sampling        what each step samples: prompts, samples (G), tokens, temperature, top-k / top-p, seed
    ├── training: Training        the trainer: FSDP2 ranks, compile, contract, AdamW's lr, micro-batches, routing replay, task
    └── engine: EngineLaunch      how the engine starts: which adapter, its environment's python, threads, launch, time limit

``to_record()`` is the run's JSON record of it (one flat mapping, the CLI's flag names with underscores).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.task import TargetTokens

CONTRACTS = ("vllm", "none")
MODES = ("strict", "audit")
FIXED_PROMPT_LEN = 8  # the weights-change evidence: one fixed prompt's log-probs, read every step


def _at_least(section: object, fields: tuple[tuple[str, int, str], ...]) -> None:
    """Each (field, lowest, flag): an integer (not a bool) of at least ``lowest``, else one line naming the flag."""
    for name, low, flag in fields:
        value = getattr(section, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise PrecisionError(f"{flag} {value!r}: an integer of at least {low}")


@dataclass(frozen=True)
class Sampling:
    """What each step samples: ``prompts`` given (the same every step), or fresh synthetic prompts of ``prompt_lens``;
    ``samples`` (G) of each at ``temperature``, ``max_tokens`` each, the sampler's top-k (0: off) and top-p (1: off), whose
    processed log-probs are over what they keep; ``seed`` of the prompts and of sampling."""

    prompts: tuple[tuple[int, ...], ...] | None = None
    prompt_lens: tuple[int, ...] = (8, 12, 16, 24)
    samples: int = 4
    max_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _at_least(self, (("samples", 1, "--samples"), ("max_tokens", 1, "--max-tokens")))
        if not 0.0 <= float(self.temperature) <= 10.0:
            raise PrecisionError(f"--temperature {self.temperature!r}: between 0 and 10 (the CLI's bound)")
        from fx_precision.engines.adapter import check_sampling

        check_sampling(self.temperature, self.samples, self.top_k, self.top_p)
        if self.prompts is None and not self.prompt_lens:
            raise PrecisionError("an on-policy run needs --prompts FILE or --prompt-lens N,N,...")

    def step_prompts(self, vocab: int, step: int) -> tuple[tuple[int, ...], ...]:
        """The prompts of ``step``: the file's every step, or fresh synthetic ones (seed + step)."""
        if self.prompts is not None:
            return self.prompts
        from fx_precision.engines.prompts import synthetic_prompts

        return synthetic_prompts(vocab, self.prompt_lens, self.seed + 1000 * (step + 1))

    def longest(self) -> int:
        """The longest sequence of the run (the fixed prompt's included): the micro-batches' fixed length (one compiled
        graph)."""
        prompt = max(len(p) for p in self.prompts) if self.prompts is not None else max(self.prompt_lens)
        return max(prompt, FIXED_PROMPT_LEN) + self.max_tokens

    def engine_positions(self) -> int:
        """The positions the engine is started with: the longest sequence, and one more token (a step's record prefills
        each whole sequence and samples one token after it)."""
        return self.longest() + 1


@dataclass(frozen=True)
class Training:
    """The trainer: FSDP2 on ``world_size`` gloo ranks, compiled (``precision_backend`` over Inductor) or not, under the
    engine's contract (``vllm``) or as users run it today (``none``), AdamW at ``lr``, ``micro_batch`` sequences per padded
    micro-batch, routing replay for an MoE model without the contract, the toy task's reward."""

    world_size: int = 2
    compiled: bool = True
    contract: str = "vllm"
    lr: float = 1.5e-2
    micro_batch: int = 4
    replay_routes: bool = False  # an MoE model: the trainer routes every token to the engine's experts (routes.py)
    task: TargetTokens = field(default_factory=TargetTokens)

    def __post_init__(self) -> None:
        _at_least(self, (("world_size", 1, "--world-size"), ("micro_batch", 1, "--micro-batch")))
        if self.contract not in CONTRACTS:
            raise PrecisionError(f"--contract {self.contract!r}: one of {', '.join(CONTRACTS)}")
        if self.replay_routes and self.contract != "none":
            raise PrecisionError(
                "--replay-routes replays the engine's routes on the trainer as users run it; the contract routes every token as "
                "the engine does already: pass --contract none to replay, or drop --replay-routes"
            )
        if not (0.0 < float(self.lr) < 1.0):
            raise PrecisionError(f"--lr {self.lr!r}: a learning rate between 0 and 1")


@dataclass(frozen=True)
class EngineLaunch:
    """How the loop starts its engine: the adapter (``name``), its environment's ``python`` (None: $FXP_ENGINE_PYTHON, else
    ./.venv-engine/bin/python), its OpenMP ``threads`` (0: the launch's own, the machine's cores at the defaults, 1 eager),
    the ``launch`` (``defaults``: as users launch it, compiled; ``eager``: the diagnostic engine, enforce_eager, no prefix
    caching, one thread, prompt log-probs), and ``timeout``, the base of every engine call's limit in seconds
    (engines/client.EngineTimeouts)."""

    name: str = "vllm"
    python: str | None = None
    threads: int = 0
    launch: str = "defaults"
    timeout: float = 300.0

    def __post_init__(self) -> None:
        _at_least(self, (("threads", 0, "--engine-threads"),))
        if self.launch not in ("eager", "defaults"):
            raise PrecisionError(f"--engine-launch {self.launch!r}: one of eager, defaults")
        from fx_precision.engines.client import EngineTimeouts

        EngineTimeouts(float(self.timeout))  # its bounds, checked before anything starts

    @property
    def eager(self) -> bool:
        """The diagnostic engine: prompt log-probs recorded, module hooks run."""
        return self.launch == "eager"


@dataclass(frozen=True)
class OnPolicyConfig:
    """One on-policy run (onpolicy/loop.py): ``steps`` RL steps from ``checkpoint``, written to ``out``; ``mode`` strict
    stops at the first mismatch, audit reports and goes on; ``modules``: the stopping step's dump records the engine's
    modules (the first origin); its sections (module docstring) hold the rest."""

    checkpoint: str
    out: str
    steps: int = 10
    mode: str = "strict"
    modules: bool = False
    overwrite: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    training: Training = field(default_factory=Training)
    engine: EngineLaunch = field(default_factory=EngineLaunch)

    def __post_init__(self) -> None:
        _at_least(self, (("steps", 1, "--steps"),))
        if self.mode not in MODES:
            raise PrecisionError(f"--mode {self.mode!r}: one of {', '.join(MODES)}")
        if self.engine.launch == "defaults" and self.training.contract != "none" and not self.training.compiled:
            raise PrecisionError(
                f"--engine-launch defaults with --contract {self.training.contract}: the engine compiles its model with Inductor "
                "and the trainer computes the same only compiled by Inductor too: drop --no-compiled, or run --engine-launch eager"
            )
        if self.modules and self.engine.launch == "defaults":
            from fx_precision.engines.adapter import COMPILED_MODULES

            raise PrecisionError(
                f"--modules with --engine-launch defaults: {COMPILED_MODULES.replace('--launch eager', '--engine-launch eager')}"
            )

    def to_record(self) -> dict[str, Any]:
        """The run's JSON record of its configuration: one flat mapping, the CLI's flag names with underscores (the engine's
        as ``engine``, ``engine_python``, ``engine_threads``, ``engine_launch``, ``engine_timeout``)."""
        engine = {("engine" if k == "name" else f"engine_{k}"): v for k, v in asdict(self.engine).items()}
        run = {k: getattr(self, k) for k in ("checkpoint", "out", "steps", "mode", "modules", "overwrite")}
        return {**run, **asdict(self.sampling), **asdict(self.training), **engine}
