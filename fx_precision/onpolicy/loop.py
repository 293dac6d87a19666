"""The on-policy loop: an FSDP2 trainer and a live engine, the engine's log-probs certified equal to the trainer's every step.

run_onpolicy(OnPolicyConfig) -> OnPolicyRun                   (the parent: preflight, then R gloo ranks)
    preflight      the checkpoint the engine can run, its weights its config's, the prompts, the task, --out
    rank r of R    one step at a time, STEPS in order; rank 0 also owns the engine (engines/client.EngineProcess)
    1 sync         every rank: the bf16 rounding of the fp32 masters, gathered whole (onpolicy/weights.py); rank 0
                   writes it to a memory-backed file, the engine loads it in place, and its tensors_digest of what it
                   loaded must equal the digest of what was sent (step 0 too: the engine never runs the disk's copy)
    2 rollout      rank 0: one fixed sequence (the weights-change evidence), then P prompts x G samples in one
                   engine call at temperature T, log-probs as the sampler took them (processed at T)
    3 contract     rank 0, --contract vllm: the engine probed on this generation's own calls (the run's attention
                   calls, every linear call size); an unmatched op class, or one that differs from step 0's (the
                   trainer's graphs follow step 0's), stops the run with the reason
    4 broadcast    the generation (sequences, log-probs, the engine's steps and logits calls, the contract) to all
    5 recompute    rank r takes sequences r, r + R, ...; padded micro-batches of one fixed shape (one compiled graph),
                   each row in the order of the engine call that computed it (contract.batch_rows row plans); no grad
    6 train        the same micro-batches with grad: the first training forward's log-probs, the GRPO loss
                   (onpolicy/grpo.py) on the toy task's reward (onpolicy/task.py), AdamW on the masters
    7 certify      rank 0 gathers every sequence's rollout, recompute and first-forward log-probs of its sampled
                   tokens and compares bit patterns: mismatches, max |delta|, ratio min / max, k3 KL
    8 record       rank 0: the step's checkpoint (the synced bf16 file + config) and the engine's dump of its rollout
                   into DIR/steps/NNNN, DIR/last moved to it (onpolicy/run_dir.py), metrics.json replaced whole
    9 decide       --mode strict: a mismatch stops the run naming step, sequence and token; audit: go on

A failure on rank 0 (the engine's, the contract's) is broadcast in the step's payload, so every rank stops with the
same one line; DIR keeps the last complete step.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.task import TargetTokens

CONTRACTS = ("vllm", "none")
MODES = ("strict", "audit")
FIXED_PROMPT_LEN = 8  # the weights-change evidence: one fixed prompt's log-probs, read every step


@dataclass(frozen=True)
class OnPolicyConfig:
    """One on-policy run (module docstring); ``prompts`` given, or fresh synthetic prompts of ``prompt_lens`` each step."""

    checkpoint: str
    out: str
    steps: int = 10
    prompts: tuple[tuple[int, ...], ...] | None = None
    prompt_lens: tuple[int, ...] = (8, 12, 16, 24)
    samples: int = 4
    max_tokens: int = 8
    temperature: float = 1.0
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
    engine_threads: int = 1
    modules: bool = False  # strict mode: the stopping step's dump records the engine's modules (the first origin)
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("samples", 1), ("max_tokens", 1), ("world_size", 1), ("micro_batch", 1),
                          ("engine_threads", 1)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PrecisionError(f"--{name.replace('_', '-')} {value!r}: an integer of at least {low}")
        if self.contract not in CONTRACTS:
            raise PrecisionError(f"--contract {self.contract!r}: one of {', '.join(CONTRACTS)}")
        if self.mode not in MODES:
            raise PrecisionError(f"--mode {self.mode!r}: one of {', '.join(MODES)}")
        if not 0.0 <= float(self.temperature) <= 10.0:
            raise PrecisionError(f"--temperature {self.temperature!r}: between 0 and 10 (the CLI's bound)")
        if not (0.0 < float(self.lr) < 1.0):
            raise PrecisionError(f"--lr {self.lr!r}: a learning rate between 0 and 1")
        from fx_precision.engines.adapter import check_sampling

        check_sampling(self.temperature, self.samples)
        if self.prompts is None and not self.prompt_lens:
            raise PrecisionError("an on-policy run needs --prompts FILE or --prompt-lens N,N,...")

    def step_prompts(self, vocab: int, step: int) -> tuple[tuple[int, ...], ...]:
        """The prompts of ``step``: the file's every step, or fresh synthetic ones (seed + step)."""
        if self.prompts is not None:
            return self.prompts
        from fx_precision.engines.prompts import synthetic_prompts

        return synthetic_prompts(vocab, self.prompt_lens, self.seed + 1000 * (step + 1))

    def longest(self) -> int:
        """The longest sequence of the run: the micro-batches' fixed length (one compiled graph)."""
        prompt = max(len(p) for p in self.prompts) if self.prompts is not None else max(self.prompt_lens)
        return max(prompt, FIXED_PROMPT_LEN) + self.max_tokens


@dataclass
class StepMetrics:
    """One step's certification, learning and time split (the table's row, metrics.json's entry)."""

    step: int
    sequences: int
    tokens: int  # sampled tokens certified
    mismatches: int  # sampled tokens whose rollout, recompute and first-forward log-probs are not one bit pattern
    recompute_mismatches: int  # rollout vs recompute
    forward_mismatches: int  # recompute vs the first training forward
    prompt_mismatches: int  # prompt tokens (the engine's prompt log-probs vs the recompute's): reported, not in the loss
    prompt_tokens: int
    max_delta: float
    ratio_min: float
    ratio_max: float
    k3_kl: float
    reward: float
    loss: float
    fixed_logprobs: str  # digest of the fixed sequence's log-probs: differs between steps when the weights did
    weights: str  # the tensors_digest the engine reported for what it loaded
    seconds: dict[str, float]
    first_mismatch: dict[str, Any] | None = None
    groups_with_signal: int = 0  # prompt groups whose rewards differ (a group of equal rewards has no gradient)

    def row(self) -> dict[str, Any]:
        return {
            "step": self.step, "mismatch": self.mismatches, "of": self.tokens, "max |delta|": self.max_delta,
            "ratio min": self.ratio_min, "ratio max": self.ratio_max, "k3": self.k3_kl, "reward": round(self.reward, 4),
            "groups learning": self.groups_with_signal, "loss": round(self.loss, 5),
            **{f"{k} s": round(v, 3) for k, v in self.seconds.items()},
        }  # fmt: skip


@dataclass
class OnPolicyRun:
    """What a run did: its config (as JSON), the engine it ran, every step's metrics, and where it stopped."""

    config: dict[str, Any]
    engine: dict[str, Any]
    contract: str | None
    steps: list[StepMetrics]
    stopped: str | None = None  # strict mode's first mismatch, else None
    out: str = ""
    origin: dict[str, Any] | None = None  # strict mode with modules: the comparator's first origin module and op

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config, "engine": self.engine, "contract": self.contract, "stopped": self.stopped, "out": self.out,
            "origin": self.origin, "steps": [dataclasses.asdict(s) for s in self.steps], "summary": self.summary(),
        }  # fmt: skip

    def median_seconds(self, *phases: str) -> float:
        """The median over steps 1.. (step 0 compiles; a one-step run: that step) of the phases' summed seconds."""
        later = self.steps[1:] or self.steps
        return statistics.median(sum(s.seconds.get(p, 0.0) for p in phases) for s in later) if later else float("nan")

    def summary(self) -> dict[str, Any]:
        rewards = [s.reward for s in self.steps]
        k = min(3, len(rewards))
        return {
            "steps": len(self.steps),
            "mismatch_free_steps": sum(1 for s in self.steps if s.mismatches == 0),
            "mismatches": sum(s.mismatches for s in self.steps),
            "tokens": sum(s.tokens for s in self.steps),
            "reward_first3": statistics.fmean(rewards[:k]) if rewards else float("nan"),
            "reward_last3": statistics.fmean(rewards[-k:]) if rewards else float("nan"),
            "median_step_seconds": self.median_seconds("step"),
        }


# ---------------------------------------------------------------------------------------------
# the parent: preflight, then the ranks
# ---------------------------------------------------------------------------------------------


def preflight(cfg: OnPolicyConfig) -> tuple[int, Any]:
    """Everything that can be refused before a rank or the engine starts: the engine runs the checkpoint's architecture,
    the weights are its config's, every prompt of every step is in the vocabulary and in the engine's bounds, the
    engine environment exists; returns the vocabulary size and the engine's python."""
    from fx_precision.checkpoints import check_weights_fit_config, read_checkpoint_config
    from fx_precision.engines import engine_adapter
    from fx_precision.engines.client import engine_python
    from fx_precision.engines.prompts import check_prompts
    from fx_precision.engines.rollout import MAX_POSITIONS

    cc = read_checkpoint_config(cfg.checkpoint)
    adapter = engine_adapter(cfg.engine)
    if not getattr(adapter, "live", False):
        raise PrecisionError(
            f"OnPolicyConfig.engine={cfg.engine!r}: that adapter reads an engine's dump files, it cannot start the engine; the loop "
            "needs a live engine: engine='vllm'"
        )
    refused = adapter.refuses(cc.config)
    if refused:
        raise PrecisionError(f"--model {cfg.checkpoint}: {refused}")
    check_weights_fit_config(cc)
    vocab = int(cc.config.vocab_size)
    positions = min(int(getattr(cc.config, "max_position_embeddings", 2048) or 2048), MAX_POSITIONS)
    min_len = int(getattr(adapter, "min_prompt_tokens", 1))
    if cfg.prompts is not None:
        check_prompts(cfg.prompts, vocab, positions, cfg.max_tokens, cfg.checkpoint, min_len=min_len)
    else:
        short = [n for n in cfg.prompt_lens if n < min_len]
        if short:
            raise PrecisionError(
                f"--prompt-lens {short[0]}: this engine build needs prompts of at least {min_len} tokens (its CPU attention stops "
                "on shorter ones)"
            )
        check_prompts(cfg.step_prompts(vocab, 0), vocab, positions, cfg.max_tokens, cfg.checkpoint, min_len=min_len)
    return vocab, engine_python(cfg.engine_python)


def run_onpolicy(cfg: OnPolicyConfig) -> OnPolicyRun:
    """The loop (module docstring): preflight, DIR prepared, R gloo ranks; rank 0's record of the run."""
    from fx_precision.onpolicy.run_dir import RunDir
    from fx_precision.ranks import run_on_ranks

    vocab, python = preflight(cfg)
    run_dir = RunDir.create(cfg.out, overwrite=cfg.overwrite, sources=(cfg.checkpoint,))
    results = run_on_ranks(_rank_main, cfg.world_size, cfg, python, str(run_dir.root), vocab)
    run: OnPolicyRun = results[0]
    run.out = str(run_dir.root)
    return run


# ---------------------------------------------------------------------------------------------
# inside a rank
# ---------------------------------------------------------------------------------------------


@dataclass
class StepData:
    """What rank 0 sends every rank each step (or the error every rank stops with)."""

    sequences: list[Any] = field(default_factory=list)  # dump.Sequence: tokens, prompt_len
    logprobs: list[torch.Tensor] = field(default_factory=list)  # [len - 1] fp32: the engine's
    steps: list[list[tuple[int, int]]] = field(default_factory=list)
    logits_calls: list[tuple[int, int]] = field(default_factory=list)
    contract: Any = None  # EngineContract of this generation (--contract vllm)
    error: str | None = None


class Clock:
    """Seconds per phase of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    def phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - since
        return now

    def total(self) -> None:
        self.seconds["step"] = time.perf_counter() - self._started


def _broadcast(value: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class EngineSide:
    """Rank 0's engine: the process, the synced weights' file, step 0's contract, the fixed sequence."""

    def __init__(self, cfg: OnPolicyConfig, python: str, root: Path, vocab: int) -> None:
        from fx_precision.engines.adapter import RolloutConfig
        from fx_precision.engines.client import EngineProcess
        from fx_precision.engines.prompts import synthetic_prompts
        from fx_precision.onpolicy.run_dir import memory_backed_dir

        self.cfg = cfg
        shm, self.memory_backed = memory_backed_dir()
        self.weights_file = shm / f"fxp-onpolicy-{os.getpid()}.safetensors"
        self.fixed = synthetic_prompts(vocab, (FIXED_PROMPT_LEN,), 7)  # the same sequence every step
        rollout = RolloutConfig(
            model=cfg.checkpoint, prompts=cfg.step_prompts(vocab, 0), engine=cfg.engine, max_tokens=cfg.max_tokens, seed=cfg.seed,
            temperature=cfg.temperature, samples=cfg.samples, threads=cfg.engine_threads, split_kv="off", logprobs="processed",
            max_model_len=max(64, cfg.longest() + 8),
        )  # fmt: skip
        self.process = EngineProcess(python, rollout, root / "engine.log")
        self.first_contract: Any = None

    def sync(self, weights: dict[str, torch.Tensor]) -> str:
        """The engine loads ``weights`` (a memory-backed file, loaded in place); its digest of them must be theirs."""
        from fx_precision.checkpoints import tensors_digest
        from fx_precision.onpolicy.weights import write_weights

        write_weights(weights, self.weights_file)
        _seconds, digest = self.process.load_weights(self.weights_file)
        sent = tensors_digest(weights.items())
        if digest != sent:
            raise PrecisionError(
                f"weight sync: the engine loaded {digest}, the trainer sent {sent}; the engine does not run the trainer's weights"
            )
        return digest

    def fixed_logprobs(self) -> str:
        """A digest of the fixed sequence's prompt log-probs under the engine's current weights."""
        import hashlib

        generation = self.process.generate(list(self.fixed), 1, 1, 1.0, 0)
        return hashlib.sha256(generation.logprobs[0][: FIXED_PROMPT_LEN - 1].numpy().tobytes()).hexdigest()[:16]

    def rollout(self, prompts: tuple[tuple[int, ...], ...], step: int) -> StepData:
        g = self.process.generate(list(prompts), self.cfg.samples, self.cfg.max_tokens, self.cfg.temperature, self.cfg.seed + step)
        return StepData(g.sequences, g.logprobs, g.steps, g.logits_calls)

    def contract(self, step: int) -> Any:
        """This generation's contract: every op class matched, and the graph-fixed ones (norm, rotary, attention,
        log-probs) those of step 0, whose contract the trainer's graphs were compiled to."""
        contract, _seconds = self.process.probe()
        if contract.unmatched:
            op_class, why = contract.unmatched[0]
            raise PrecisionError(
                f"step {step}: the engine's {op_class} matched no candidate the contract knows ({why}); the trainer cannot compute "
                "what the engine does: run with --contract none to see the gap"
            )
        if self.first_contract is None:
            self.first_contract = contract
        else:
            for name in ("norm", "rotary", "attention", "logprobs"):
                if getattr(contract, name) != getattr(self.first_contract, name):
                    raise PrecisionError(
                        f"step {step}: the engine's {name} is {getattr(contract, name)}, at step 0 {getattr(self.first_contract, name)}: "
                        "the engine changed its arithmetic mid-run; restart the run"
                    )
        return contract

    def record(self, run_dir: Any, step: int, modules: bool = False) -> None:
        """DIR/steps/NNNN: the checkpoint the engine ran (the synced file + config) and the engine's dump of this step's
        rollout (``modules``: with every module's inputs and outputs, for the comparator's first origin); ``last`` moved
        to it."""
        import shutil

        staging = run_dir.staging(step)
        try:
            run_dir.write_checkpoint(staging, self.weights_file, self.cfg.checkpoint)
            self.process.request("dump", path=str(staging / "rollout"), seed=self.cfg.seed + step, samples=self.cfg.samples,
                                 modules=modules)  # fmt: skip
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # nothing half-written: DIR keeps the last complete step
            raise
        run_dir.commit(step, staging)

    def close(self) -> None:
        self.process.close()
        self.weights_file.unlink(missing_ok=True)


@dataclass
class MicroBatch:
    """A fixed-shape slice of this rank's sequences: [rows, length] ids, the engine rows, each row's sequence index (-1:
    a dummy row that pads the batch to its fixed size) and prompt length."""

    ids: torch.Tensor
    rows: Any
    index: list[int]
    prompt_lens: list[int]


def micro_batches(data: StepData, plans: Sequence[Any] | None, orders: Any, rank: int, world: int, size: int,
                  length: int) -> list[MicroBatch]:  # fmt: skip
    """Rank ``rank``'s sequences (``rank::world``) in micro-batches of ``size`` rows x ``length`` positions, right-padded
    (a row's padding is never computed by the engine: row plan 0, causal attention never reaches it); every rank makes
    the same number of micro-batches (FSDP2's gathers are collectives), the short ones padded with dummy rows."""
    from fx_precision.contract.batch_rows import EngineRows, RowPlan

    n = len(data.sequences)
    per_rank = -(-n // world)
    count = -(-per_rank // size)
    mine = list(range(rank, n, world))
    batches = []
    for b in range(count):
        index = mine[b * size : (b + 1) * size]
        index = index + [-1] * (size - len(index))
        ids = torch.zeros(size, length, dtype=torch.long)
        row_plans, prompt_lens = [], []
        for r, i in enumerate(index):
            if i < 0:
                row_plans.append(RowPlan((0,), ()))
                prompt_lens.append(1)
                continue
            s = data.sequences[i]
            ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
            prompt_lens.append(s.prompt_len)
            if plans is not None:
                row_plans.append(plans[i])
        rows = EngineRows.of(row_plans, orders, length) if plans is not None else None
        batches.append(MicroBatch(ids, rows, index, prompt_lens))
    return batches


def _forward_logprobs(side: Any, batch: MicroBatch, temperature: float) -> torch.Tensor:
    """[rows, length - 1] log-probs of every next token, as the engine's sampler took them (processed at T)."""
    from fx_precision.contract.vocabulary import LogprobForm
    from fx_precision.logprobs import token_logprobs

    logits = side.logits(batch.ids, batch.rows)
    return token_logprobs(logits, batch.ids, LogprobForm.PROCESSED, temperature, batch.prompt_lens)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def certify(data: StepData, recompute: dict[int, torch.Tensor], forward: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Bit patterns of the sampled tokens' log-probs: rollout vs recompute vs the first training forward; prompt tokens
    (rollout vs recompute) counted apart. The first mismatch: its sequence, token position and the three values."""
    from fx_precision.onpolicy.grpo import ratio_stats

    tokens = prompt_tokens = m_rec = m_fwd = m_all = m_prompt = 0
    max_delta = 0.0
    first = None
    train_all, roll_all = [], []
    for i, s in enumerate(data.sequences):
        engine = data.logprobs[i].float()
        n = len(s.tokens) - 1
        rec, fwd = recompute[i][:n], forward[i][:n]
        sampled = slice(s.prompt_len - 1, n)
        e, r, f = engine[sampled], rec[sampled], fwd[sampled]
        bad_rec = _bits(e) != _bits(r)
        bad_fwd = _bits(r) != _bits(f)
        bad = bad_rec | bad_fwd
        tokens += int(e.numel())
        m_rec += int(bad_rec.sum())
        m_fwd += int(bad_fwd.sum())
        m_all += int(bad.sum())
        finite = torch.isfinite(e) & torch.isfinite(f)
        if bool(finite.any()):
            max_delta = max(max_delta, float((e[finite].double() - f[finite].double()).abs().max()))
        if first is None and bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            first = {"sequence": i, "token": s.prompt_len + t, "token_id": int(s.tokens[s.prompt_len + t]),
                     "rollout": float(e[t]), "recompute": float(r[t]), "first_forward": float(f[t])}  # fmt: skip
        pe, pr = engine[: s.prompt_len - 1], rec[: s.prompt_len - 1]
        prompt_tokens += int(pe.numel())
        m_prompt += int((_bits(pe) != _bits(pr)).sum())
        train_all.append(f)
        roll_all.append(e)
    stats = ratio_stats(torch.cat(train_all), torch.cat(roll_all)) if train_all else ratio_stats(torch.empty(0), torch.empty(0))
    return {"tokens": tokens, "mismatches": m_all, "recompute_mismatches": m_rec, "forward_mismatches": m_fwd,
            "prompt_tokens": prompt_tokens, "prompt_mismatches": m_prompt, "max_delta": max_delta, "first": first, **stats}  # fmt: skip


def _rank_main(rank: int, world: int, cfg: OnPolicyConfig, python: str, root: str, vocab: int) -> OnPolicyRun | None:
    """One rank of the loop (module docstring). Rank 0 returns the run's record."""
    import torch.distributed as dist

    from fx_precision.checkpoints import stored_tensors
    from fx_precision.contract.batch_rows import row_plans
    from fx_precision.onpolicy.grpo import group_advantages, grpo_token_loss
    from fx_precision.onpolicy.run_dir import RunDir
    from fx_precision.onpolicy.weights import checkpoint_bf16_weights, full_bf16_weights
    from fx_precision.ranks import cpu_mesh
    from fx_precision.training_side import AsUsersRunIt, RunConfig, build_training_side, compile_limits

    torch.set_num_threads(max(1, int(os.environ.get("FXP_TRAINER_THREADS", "1"))))
    mesh = cpu_mesh(world)
    names = [t.name for t in stored_tensors(cfg.checkpoint)]
    run_dir = RunDir(Path(root)) if rank == 0 else None
    engine: EngineSide | None = None
    described = {"task": cfg.task.describe(), "prompts": None if cfg.prompts is None else len(cfg.prompts)}
    record = OnPolicyRun(dataclasses.asdict(cfg) | described, {}, None, [])
    side: Any = None
    optimizer: Any = None
    length = cfg.longest()
    try:
        engine = _broadcast_start(lambda: EngineSide(cfg, python, Path(root), vocab) if rank == 0 else None)
        for step in range(cfg.steps):
            clock = Clock()
            t = time.perf_counter()
            # step 0: the masters are the checkpoint's values (loaded as fp32), so their bf16 rounding is read off it;
            # later steps: gathered from the trainer (a collective under FSDP2: every rank)
            weights = checkpoint_bf16_weights(cfg.checkpoint, names) if side is None else full_bf16_weights(side.model, names)
            data = StepData()
            fixed = digest = ""
            if rank == 0:
                assert engine is not None
                try:
                    digest = engine.sync(weights)
                    t = clock.phase("sync", t)
                    fixed = engine.fixed_logprobs()
                    data = engine.rollout(cfg.step_prompts(vocab, step), step)
                    t = clock.phase("rollout", t)
                    if cfg.contract == "vllm":
                        data.contract = engine.contract(step)
                        t = clock.phase("probe", t)
                except Exception as exc:  # every rank stops with rank 0's one line (it travels in the broadcast)
                    data = StepData(error=str(exc) if isinstance(exc, PrecisionError) else f"{type(exc).__name__}: {exc}")
                if step == 0:
                    record.engine = dict(engine.process.info)
            del weights
            data = _broadcast(data)
            if data.error is not None:
                raise PrecisionError(data.error)
            if side is None:  # step 0: the side under step 0's contract, compiled once for the run's one shape
                side = build_training_side(RunConfig(cfg.checkpoint, policy=AsUsersRunIt(), contract=data.contract,
                                                     compiled=cfg.compiled, train=True), mesh)  # fmt: skip
                optimizer = torch.optim.AdamW(side.model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
                if rank == 0:
                    record.contract = data.contract.describe() if data.contract is not None else None
            plans = row_plans(data.sequences, {"steps": data.steps, "logits_calls": data.logits_calls}) if data.contract else None
            orders = data.contract.linears if data.contract is not None else None
            batches = micro_batches(data, plans, orders, rank, world, cfg.micro_batch, length)
            rewards = [cfg.task.reward(s.tokens[s.prompt_len :]) for s in data.sequences]
            advantages = group_advantages(rewards, cfg.samples)
            generated = sum(len(s.tokens) - s.prompt_len for s in data.sequences)
            recompute: dict[int, torch.Tensor] = {}
            forward: dict[int, torch.Tensor] = {}
            with compile_limits(8):
                t = time.perf_counter()
                with torch.no_grad():
                    for batch in batches:
                        lp = _forward_logprobs(side, batch, cfg.temperature)
                        for r, i in enumerate(batch.index):
                            if i >= 0:
                                recompute[i] = lp[r].clone()
                t = clock.phase("recompute", t)
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for batch in batches:
                    lp = _forward_logprobs(side, batch, cfg.temperature)
                    rollout_lp = torch.zeros_like(lp)
                    weight = torch.zeros_like(lp)
                    for r, i in enumerate(batch.index):
                        if i < 0:
                            continue
                        s = data.sequences[i]
                        forward[i] = lp[r].detach().clone()
                        n = len(s.tokens) - 1
                        rollout_lp[r, :n] = data.logprobs[i][:n]
                        weight[r, s.prompt_len - 1 : n] = 1.0  # the sampled tokens: the loss's
                    adv = torch.tensor([float(advantages[i]) if i >= 0 else 0.0 for i in batch.index]).unsqueeze(1)
                    per_token = grpo_token_loss(lp, rollout_lp.detach(), adv.expand_as(lp))
                    loss = (per_token * weight).sum() * (world / max(1, generated))  # FSDP2 averages gradients over ranks
                    loss.backward()
                    loss_sum += float(loss.detach()) / world
                optimizer.step()
                t = clock.phase("train", t)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (recompute, forward, loss_sum))
            outcome: tuple[str | None, str | None] = (None, None)  # (an error every rank raises, strict mode's stop)
            if rank == 0:
                assert engine is not None and run_dir is not None
                outcome = _finish_step(cfg, step, engine, run_dir, record, data, gathered, rewards, clock, fixed, digest, t)
            error, stopped = _broadcast(outcome)
            if error is not None:
                raise PrecisionError(error)
            if stopped is not None:
                record.stopped = stopped
                break
    finally:
        if engine is not None:
            engine.close()
    return record if rank == 0 else None


def _finish_step(cfg: OnPolicyConfig, step: int, engine: EngineSide, run_dir: Any, record: OnPolicyRun, data: StepData,
                 gathered: list[Any], rewards: list[float], clock: Clock, fixed: str, digest: str,
                 t: float) -> tuple[str | None, str | None]:  # fmt: skip
    """Rank 0 after a step's update: certify, record the step (DIR, metrics.json), decide. Returns (an error every rank
    stops with, strict mode's stop), each None where there is none."""
    found = certify(data, {i: v for part in gathered for i, v in part[0].items()}, {i: v for part in gathered for i, v in part[1].items()})
    stop = cfg.mode == "strict" and found["mismatches"] > 0
    try:
        engine.record(run_dir, step, modules=stop and cfg.modules)
    except PrecisionError as exc:
        return str(exc), None
    clock.phase("save", t)
    clock.total()
    metrics = StepMetrics(
        step, len(data.sequences), found["tokens"], found["mismatches"], found["recompute_mismatches"], found["forward_mismatches"],
        found["prompt_mismatches"], found["prompt_tokens"], found["max_delta"], found["ratio_min"], found["ratio_max"],
        found["k3_kl"], statistics.fmean(rewards), sum(part[2] for part in gathered), fixed, digest, dict(clock.seconds),
        found["first"], sum(1 for g in range(0, len(rewards), cfg.samples) if len(set(rewards[g : g + cfg.samples])) > 1),
    )  # fmt: skip
    record.steps.append(metrics)
    run_dir.write_metrics(record.to_dict())
    if not stop:
        return None, None
    first, root = found["first"], run_dir.root
    return None, (
        f"step {step}: {metrics.mismatches} of {metrics.tokens} sampled log-prob(s) differ; first at sequence {first['sequence']}, "
        f"token {first['token']} (id {first['token_id']}): rollout {first['rollout']!r}, recompute {first['recompute']!r}, first "
        f"training forward {first['first_forward']!r}. {root}/last holds the step: fx-precision compare --model "
        f"{root}/last/checkpoint --rollout {root}/last/rollout{' --contract vllm' if cfg.contract == 'vllm' else ''} names where "
        "the two sides part" + ("" if cfg.modules else " (run with --modules to record the engine's modules for the first origin)")
    )


def _broadcast_start(start: Any) -> Any:
    """``start()`` on every rank (rank 0 starts the engine, the others None); a failure reaches every rank as one
    PrecisionError."""
    made, error = None, None
    try:
        made = start()
    except PrecisionError as exc:
        error = str(exc)
    error = _broadcast(error)
    if error is not None:
        raise PrecisionError(error)
    return made
