"""One on-policy run's configuration, checked field by field when it is made (one line naming the flag and the fix)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.task import TargetTokens

CONTRACTS = ("vllm", "none")
MODES = ("strict", "audit")
FIXED_PROMPT_LEN = 8  # the weights-change evidence: one fixed prompt's log-probs, read every step


@dataclass(frozen=True)
class OnPolicyConfig:
    """One on-policy run (onpolicy/loop.py); ``prompts`` given, or fresh synthetic prompts of ``prompt_lens`` each step."""

    checkpoint: str
    out: str
    steps: int = 10
    prompts: tuple[tuple[int, ...], ...] | None = None
    prompt_lens: tuple[int, ...] = (8, 12, 16, 24)
    samples: int = 4
    max_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0  # the sampler's top-k (0: off) and top-p (1: off); the log-probs are the processed ones over what they keep
    top_p: float = 1.0
    world_size: int = 2
    compiled: bool = True
    contract: str = "vllm"
    mode: str = "strict"
    lr: float = 1.5e-2
    micro_batch: int = 4
    seed: int = 0
    task: TargetTokens = field(default_factory=TargetTokens)
    engine: str = "vllm"
    engine_python: str | None = None
    engine_threads: int = 0  # the engine's OpenMP threads; 0: the launch's own (1 eager, the machine's cores at the defaults)
    engine_launch: str = "defaults"  # the engine as users launch it (compiled; the contract follows it compiled); "eager":
    # the diagnostic engine (enforce_eager, no prefix caching, one thread, prompt log-probs)
    engine_timeout: float = 300.0  # seconds: the base of every engine call's limit (engines/client.EngineTimeouts)
    replay_routes: bool = False  # an MoE model: the trainer routes every token to the engine's experts (routes.py)
    modules: bool = False  # strict mode: the stopping step's dump records the engine's modules (the first origin)
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("samples", 1), ("max_tokens", 1), ("world_size", 1), ("micro_batch", 1),
                          ("engine_threads", 0)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PrecisionError(f"--{name.replace('_', '-')} {value!r}: an integer of at least {low}")
        if self.contract not in CONTRACTS:
            raise PrecisionError(f"--contract {self.contract!r}: one of {', '.join(CONTRACTS)}")
        if self.replay_routes and self.contract != "none":
            raise PrecisionError(
                "--replay-routes replays the engine's routes on the trainer as users run it; the contract routes every token as "
                "the engine does already: pass --contract none to replay, or drop --replay-routes"
            )
        if self.engine_launch not in ("eager", "defaults"):
            raise PrecisionError(f"--engine-launch {self.engine_launch!r}: one of eager, defaults")
        if self.engine_launch == "defaults" and self.contract != "none" and not self.compiled:
            raise PrecisionError(
                f"--engine-launch defaults with --contract {self.contract}: the engine compiles its model with Inductor and the "
                "trainer computes the same only compiled by Inductor too: drop --no-compiled, or run --engine-launch eager"
            )
        if self.modules and self.engine_launch == "defaults":
            from fx_precision.engines.adapter import COMPILED_MODULES

            raise PrecisionError(
                f"--modules with --engine-launch defaults: {COMPILED_MODULES.replace('--launch eager', '--engine-launch eager')}"
            )
        if self.mode not in MODES:
            raise PrecisionError(f"--mode {self.mode!r}: one of {', '.join(MODES)}")
        if not 0.0 <= float(self.temperature) <= 10.0:
            raise PrecisionError(f"--temperature {self.temperature!r}: between 0 and 10 (the CLI's bound)")
        if not (0.0 < float(self.lr) < 1.0):
            raise PrecisionError(f"--lr {self.lr!r}: a learning rate between 0 and 1")
        from fx_precision.engines.adapter import check_sampling
        from fx_precision.engines.client import EngineTimeouts

        check_sampling(self.temperature, self.samples, self.top_k, self.top_p)
        EngineTimeouts(float(self.engine_timeout))  # its bounds, checked before anything starts
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
