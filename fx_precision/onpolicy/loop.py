"""The on-policy loop: an FSDP2 trainer and a live engine, the engine's log-probs certified equal to the trainer's every step.

run_onpolicy(OnPolicyConfig) -> OnPolicyRun                   (the parent: preflight, DIR locked, then R gloo ranks)
    preflight      the checkpoint the engine can run, its weights its config's and finite, the prompts (with what the
                   loop adds: the fixed sequence, the sampled tokens) in the engine's positions, the task, --out
    rank r of R    one step at a time, STEPS in order; rank 0 also owns the engine (onpolicy/engine_side.py)

    STEPS          where      what
    gather         every      the bf16 rounding of the fp32 masters, gathered whole (onpolicy/weights.py; step 0 reads
                              the checkpoint: the masters are its values)
    sync           rank 0     the engine loads them in place; its digest of what it loaded must be the trainer's
    rollout        rank 0     the fixed sequence (the weights-change evidence), then P prompts x G samples in one call
    contract       rank 0     --contract vllm: the engine probed on this generation's own calls; an unmatched op class,
                              or one that differs from step 0's (the trainer's graphs follow step 0's), stops the run
    broadcast      every      the generation (or rank 0's failure: every rank stops with its one line)
    build          every      step 0: the training side under step 0's contract, compiled once for the run's one shape
    recompute      every      rank r's sequences in padded micro-batches of one shape, each row in the order of the
                              engine call that computed it (contract.batch_rows row plans); no grad; an MoE model with
                              --replay-routes: every token on the experts the engine routed it to (routes.py)
    train          every      the same micro-batches with grad: the first training forward's log-probs, the GRPO loss on
                              the toy task's reward, AdamW on the masters
    certify        every      rank 0 gathers every sequence's three log-probs and compares bit patterns
                              (onpolicy/metrics.py); NaN or Inf anywhere is never equal and marks the step
    record         rank 0     the step's checkpoint and rollout dump into DIR/steps/NNNN, written whole, metrics.json
    decide         every      --mode strict: a mismatch or a non-finite step stops the run naming it; audit: go on

Faults end the run in one piece: a stop signal (SIGTERM, SIGINT) to the parent stops the ranks and the engine within
seconds and leaves DIR at the last complete step; a rank or engine that dies, or an engine that does not answer in
time (--engine-timeout), ends it with one line naming what failed; no process outlives the run (lifetime.py), no
weights file is left in shared memory, and no half-written step stays in DIR.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fx_precision.errors import PrecisionError
from fx_precision.onpolicy.batches import MicroBatch, StepData, forward_logprobs, micro_batches
from fx_precision.onpolicy.config import FIXED_PROMPT_LEN, OnPolicyConfig
from fx_precision.onpolicy.metrics import Certificate, OnPolicyRun, StepMetrics, certify
from fx_precision.routes import config_moe

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fx_precision.contract.vocabulary import LogprobForm
    from fx_precision.onpolicy.engine_side import EngineSide
    from fx_precision.onpolicy.run_dir import RunDir
    from fx_precision.routes import RouteTap
    from fx_precision.training_side import TrainingSide

# ---------------------------------------------------------------------------------------------
# the parent: preflight, DIR, then the ranks
# ---------------------------------------------------------------------------------------------


def preflight(cfg: OnPolicyConfig) -> tuple[int, str]:
    """Everything that can be refused before a rank or the engine starts: the engine preflight (engines/preflight.py:
    a live engine that runs the checkpoint's architecture, weights of its config and finite, every prompt of every step
    in the vocabulary and within the engine's positions), then what only training refuses (GDN under aot_eager at a
    micro-batch of 2+, route replay on a dense model, the run's longest sequence with the loop's fixed prompt), the
    engine environment; returns the vocabulary size and the engine's python."""
    from fx_precision.contract.gdn_form import gdn_layer_count
    from fx_precision.engines.client import engine_python
    from fx_precision.engines.preflight import engine_preflight

    checked = engine_preflight(cfg.checkpoint, cfg.engine.name, live=True, finite=True)
    config = checked.checkpoint.config
    if not cfg.training.compiled and cfg.training.micro_batch > 1 and gdn_layer_count(config):
        raise PrecisionError(
            f"--no-compiled with --micro-batch {cfg.training.micro_batch}: {cfg.checkpoint} has GatedDeltaNet layers, whose backward under "
            "aot_eager fails at a batch of 2 or more (an upstream torch / transformers bug); drop --no-compiled (Inductor) or pass "
            "--micro-batch 1"
        )
    if config_moe(config) is None and cfg.training.replay_routes:
        raise PrecisionError(f"--replay-routes: {cfg.checkpoint} is a dense model (its config names no expert count): drop the flag")
    sampling = cfg.sampling
    if sampling.prompts is not None:
        checked.check_prompts(sampling.prompts, sampling.max_tokens)
    else:
        checked.check_prompt_lens(sampling.prompt_lens)
        checked.check_prompts(sampling.step_prompts(checked.vocab, 0), sampling.max_tokens)
    if sampling.engine_positions() > checked.positions:
        raise PrecisionError(
            f"the run needs {sampling.engine_positions()} positions (the longest prompt, at least the loop's fixed "
            f"{FIXED_PROMPT_LEN}-token one, plus --max-tokens {sampling.max_tokens}, plus the one token a step's record samples), "
            f"over the {checked.positions} of {cfg.checkpoint}: shorten the prompts or sample fewer"
        )
    return checked.vocab, engine_python(cfg.engine.python)


def run_onpolicy(cfg: OnPolicyConfig) -> OnPolicyRun:
    """The loop (module docstring): preflight, DIR locked and prepared, R gloo ranks; rank 0's record of the run.
    A stop signal raises ``lifetime.Stopped`` after the ranks and the engine have stopped and DIR is whole."""
    from fx_precision.engines.weights_file import memory_backed_dir, remove_stale
    from fx_precision.lifetime import stop_on_signals
    from fx_precision.onpolicy.run_dir import RunDir
    from fx_precision.ranks import run_on_ranks

    vocab, python = preflight(cfg)
    with stop_on_signals():
        run_dir = RunDir.create(cfg.out, overwrite=cfg.overwrite, sources=(cfg.checkpoint,))
        try:
            results = run_on_ranks(_rank_main, cfg.training.world_size, cfg, python, str(run_dir.root), vocab)
        finally:
            run_dir.release()
            remove_stale(memory_backed_dir()[0])  # a weights file whose owner (rank 0's engine client) was killed
    run: OnPolicyRun = results[0]
    run.out = str(run_dir.root)
    return run


# ---------------------------------------------------------------------------------------------
# inside a rank: the steps
# ---------------------------------------------------------------------------------------------


class Clock:
    """Seconds per phase of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def total(self) -> None:
        self.seconds["step"] = time.perf_counter() - self._started


@dataclass
class Rank:
    """What one rank keeps from step to step."""

    rank: int
    world: int
    cfg: OnPolicyConfig
    vocab: int
    root: Path
    names: list[str]
    mesh: DeviceMesh | None
    record: OnPolicyRun
    engine: EngineSide | None = None  # rank 0's
    side: TrainingSide | None = None  # built at step 0
    optimizer: torch.optim.Optimizer | None = None

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def running(self) -> EngineSide:
        """Rank 0's engine (the steps that call it run on rank 0, after it started)."""
        assert self.engine is not None, "the engine is rank 0's, started before the first step"
        return self.engine

    @property
    def trainer(self) -> tuple[TrainingSide, torch.optim.Optimizer]:
        """The training side and its optimizer (built at step 0, before any step trains)."""
        assert self.side is not None and self.optimizer is not None, "the training side is built at step 0"
        return self.side, self.optimizer


@dataclass
class StepState:
    """One step's values, as the steps make them."""

    step: int
    clock: Clock = field(default_factory=Clock)
    weights: dict[str, torch.Tensor] | None = None
    digest: str = ""
    fixed: str = ""
    data: StepData = field(default_factory=StepData)
    batches: list[MicroBatch] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    recompute: dict[int, torch.Tensor] = field(default_factory=dict)
    forward: dict[int, torch.Tensor] = field(default_factory=dict)
    routes: list[RouteTap] = field(default_factory=list)  # --replay-routes: each micro-batch's
    loss: float = 0.0
    metrics: StepMetrics | None = None
    error: str | None = None  # rank 0's failure, sent to every rank at the next broadcast
    stop: str | None = None  # why the run stops after this step (strict mode)


def _broadcast(value: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_weights(r: Rank, s: StepState) -> None:
    from fx_precision.onpolicy.weights import checkpoint_bf16_weights, full_bf16_weights

    s.weights = checkpoint_bf16_weights(r.cfg.checkpoint, r.names) if r.side is None else full_bf16_weights(r.side.model, r.names)
    if not r.lead:
        s.weights = None


def sync_engine(r: Rank, s: StepState) -> None:
    assert s.weights is not None
    s.digest = r.running.sync(s.weights)
    if s.step == 0:
        r.record.engine = r.running.process.describe()


def roll_out(r: Rank, s: StepState) -> None:
    s.fixed = r.running.fixed_logprobs()
    s.data = r.running.rollout(r.cfg.sampling.step_prompts(r.vocab, s.step), s.step)


def read_contract(r: Rank, s: StepState) -> None:
    if r.cfg.training.contract == "vllm":
        s.data.contract = r.running.contract(s.step)


def broadcast_generation(r: Rank, s: StepState) -> None:
    s.data = _broadcast(dataclasses.replace(s.data, error=s.error) if r.lead else None)
    if s.data.error is not None:
        raise PrecisionError(s.data.error)


def build_side(r: Rank, s: StepState) -> None:
    if r.side is not None:
        return
    from fx_precision.training_side import AsUsersRunIt, RunConfig, build_training_side

    side = RunConfig(r.cfg.checkpoint, policy=AsUsersRunIt(), contract=s.data.contract, compiled=r.cfg.training.compiled, train=True)
    r.side = build_training_side(side, r.mesh)
    r.optimizer = torch.optim.AdamW(r.side.model.parameters(), lr=r.cfg.training.lr, betas=(0.9, 0.99), weight_decay=0.0)
    if r.lead:
        r.record.contract = s.data.contract.describe() if s.data.contract is not None else None


def _logprob_form(data: StepData) -> LogprobForm:
    """The log-probs the engine returned: the contract's reading of them, else the loop's request (processed at T)."""
    from fx_precision.contract.vocabulary import LogprobForm

    return data.contract.logprob_form() if data.contract is not None else LogprobForm.PROCESSED


def recompute(r: Rank, s: StepState) -> None:
    from fx_precision.contract.batch_rows import row_plans
    from fx_precision.training_side import compile_limits

    data = s.data
    engine = {"steps": data.steps, "logits_calls": data.logits_calls, "prompt_logprobs": r.cfg.engine.eager}
    contract = data.contract
    plans = row_plans(data.sequences, engine, tiling=contract.kv_tiling, gdn=contract.gdn is not None) if contract else None
    orders = data.contract.linears if data.contract is not None else None
    s.batches = micro_batches(data, plans, orders, r.rank, r.world, r.cfg.training.micro_batch, r.cfg.sampling.longest())
    if r.cfg.training.replay_routes:
        s.routes = step_routes(data, s.batches, r.cfg.sampling.longest())
    with compile_limits(8), torch.no_grad():
        for b, batch in enumerate(s.batches):
            with _routes(s, b):
                lp = forward_logprobs(r.trainer[0], batch, _logprob_form(data), r.cfg.sampling)
            for row, i in enumerate(batch.index):
                if i >= 0:
                    s.recompute[i] = lp[row].clone()


def step_routes(data: StepData, batches: list[MicroBatch], length: int) -> list[RouteTap]:
    """--replay-routes: each micro-batch's RouteTap replaying the engine's routes of its rows (routes.py; a padding row or
    position keeps the model's own)."""
    from fx_precision.routes import UNROUTED, MoeSpec, RouteTap, routes_of

    engine = {**(data.routes or {}), "steps": data.steps}
    spec = MoeSpec.of(engine)
    if spec is None or engine.get("routes") is None:
        why = (data.routes or {}).get("routes_missing") or "the engine recorded no routes"
        raise PrecisionError(f"--replay-routes: {why}")
    per_sequence = routes_of(data.sequences, engine)
    taps = []
    for batch in batches:
        replay = torch.full((len(spec.layers), len(batch.index), length, spec.top_k), UNROUTED, dtype=torch.int64)
        for row, i in enumerate(batch.index):
            if i >= 0:
                replay[:, row, : per_sequence[i].shape[1]] = per_sequence[i]
        taps.append(RouteTap(spec, replay=replay.reshape(len(spec.layers), -1, spec.top_k)))
    return taps


def _routes(s: StepState, batch: int) -> Any:
    """The micro-batch's route replay (a fresh tap per forward), or nothing."""
    import contextlib

    if not s.routes:
        return contextlib.nullcontext()
    tap = s.routes[batch]
    return type(tap)(tap.spec, replay=tap.replay)


def train(r: Rank, s: StepState) -> None:
    from fx_precision.onpolicy.grpo import group_advantages, grpo_token_loss
    from fx_precision.training_side import compile_limits

    data = s.data
    s.rewards = [r.cfg.training.task.reward(seq.tokens[seq.prompt_len :]) for seq in data.sequences]
    advantages = group_advantages(s.rewards, r.cfg.sampling.samples)
    generated = sum(len(seq.tokens) - seq.prompt_len for seq in data.sequences)
    r.trainer[1].zero_grad(set_to_none=True)
    with compile_limits(8):
        for b, batch in enumerate(s.batches):
            with _routes(s, b):
                lp = forward_logprobs(r.trainer[0], batch, _logprob_form(data), r.cfg.sampling)
            rollout_lp = torch.zeros_like(lp)
            weight = torch.zeros_like(lp)
            for row, i in enumerate(batch.index):
                if i < 0:
                    continue
                seq = data.sequences[i]
                s.forward[i] = lp[row].detach().clone()
                n, first = len(seq.tokens) - 1, seq.prompt_len - 1
                rollout_lp[row, first:n] = data.logprobs[i][first:n]  # the sampled tokens': the prompt's are NaN unless asked
                weight[row, first:n] = 1.0  # the sampled tokens: the loss's
            adv = torch.tensor([float(advantages[i]) if i >= 0 else 0.0 for i in batch.index]).unsqueeze(1)
            per_token = grpo_token_loss(lp, rollout_lp.detach(), adv.expand_as(lp))
            loss = (per_token * weight).sum() * (r.world / max(1, generated))  # FSDP2 averages gradients over ranks
            loss.backward()
            s.loss += float(loss.detach()) / r.world
    r.trainer[1].step()


def _non_finite(found: Certificate, loss: float, rewards: list[float]) -> str | None:
    parts = [f"{found.non_finite} of {found.tokens} sampled log-probs"] if found.non_finite else []
    parts += ["the loss"] if not math.isfinite(loss) else []
    parts += ["rewards"] if not all(math.isfinite(x) for x in rewards) else []
    return ", ".join(parts) or None


def certify_step(r: Rank, s: StepState) -> None:
    import torch.distributed as dist

    gathered: list[Any] = [None] * r.world
    dist.all_gather_object(gathered, (s.recompute, s.forward, s.loss))
    if not r.lead:
        return
    recomputed = {i: v for part in gathered for i, v in part[0].items()}
    found = certify(s.data, recomputed, {i: v for part in gathered for i, v in part[1].items()}, r.cfg.engine.eager)
    loss = sum(part[2] for part in gathered)
    samples = r.cfg.sampling.samples
    signal = sum(1 for g in range(0, len(s.rewards), samples) if len(set(s.rewards[g : g + samples])) > 1)
    s.metrics = StepMetrics(s.step, len(s.data.sequences), found, statistics.fmean(s.rewards) if s.rewards else math.nan, loss,
                            s.fixed, s.digest, {}, signal, _non_finite(found, loss, s.rewards))  # fmt: skip


def record_step(r: Rank, s: StepState) -> None:
    assert s.metrics is not None
    cfg, found = r.cfg, s.metrics.certificate
    strict = cfg.mode == "strict"
    s.stop = _why_stop(cfg, s.metrics, r.root) if strict else None
    r.running.record(_run_dir(r), s.step, modules=s.stop is not None and cfg.modules and found.mismatches > 0)


def _run_dir(r: Rank) -> RunDir:
    from fx_precision.onpolicy.run_dir import RunDir

    return RunDir(r.root)


def _why_stop(cfg: OnPolicyConfig, m: StepMetrics, root: Path) -> str | None:
    """Strict mode's stop after step ``m``: a non-finite value, or the first mismatch, each named."""
    if not m.learned:
        return (f"step {m.step}: NaN or Inf in {m.non_finite}: the policy or the engine produced non-finite values, and the step's "
                f"reward and update mean nothing. {root}/last holds the step: fx-precision compare --model {root}/last/checkpoint "
                f"--rollout {root}/last/rollout shows where")  # fmt: skip
    first = m.certificate.first
    if first is None:
        return None
    return (
        f"step {m.step}: {m.mismatches} of {m.tokens} sampled log-prob(s) differ; first at sequence {first.sequence}, "
        f"token {first.token} (id {first.token_id}): rollout {first.rollout!r}, recompute {first.recompute!r}, first "
        f"training forward {first.first_forward!r}. {root}/last holds the step: fx-precision compare --model "
        f"{root}/last/checkpoint --rollout {root}/last/rollout{' --contract vllm' if cfg.training.contract == 'vllm' else ''} names where "
        "the two sides part" + ("" if cfg.modules else " (run with --modules to record the engine's modules for the first origin)")
    )


def decide(r: Rank, s: StepState) -> None:
    if r.lead and s.error is None:
        assert s.metrics is not None
        s.clock.total()
        s.metrics.seconds = dict(s.clock.seconds)
        r.record.steps.append(s.metrics)
        _run_dir(r).write_metrics(r.record.to_dict())
    error, stop = _broadcast((s.error, s.stop) if r.lead else None)
    if error is not None:
        raise PrecisionError(error)
    s.stop = stop


@dataclass(frozen=True)
class Step:
    """One step of the loop: its name, the clock phase it counts to, whether rank 0 alone runs it (its failure is
    kept for the next broadcast, where every rank stops with its one line), and the function."""

    name: str
    phase: str | None
    lead_only: bool
    run: Callable[[Rank, StepState], None]


STEPS: tuple[Step, ...] = (
    Step("gather", "sync", False, gather_weights),
    Step("sync", "sync", True, sync_engine),
    Step("rollout", "rollout", True, roll_out),
    Step("contract", "probe", True, read_contract),
    Step("broadcast", None, False, broadcast_generation),
    Step("build", None, False, build_side),
    Step("recompute", "recompute", False, recompute),
    Step("train", "train", False, train),
    Step("certify", None, False, certify_step),
    Step("record", "save", True, record_step),
    Step("decide", None, False, decide),
)


def run_step(r: Rank, s: StepState) -> None:
    """STEPS in order for one step of this rank."""
    for step in STEPS:
        if step.lead_only and (not r.lead or s.error is not None):
            continue
        started = time.perf_counter()
        if step.lead_only:
            try:
                step.run(r, s)
            except Exception as exc:  # every rank stops with rank 0's one line (it travels in the next broadcast)
                s.error = str(exc) if isinstance(exc, PrecisionError) else f"{type(exc).__name__}: {exc}"
        else:
            step.run(r, s)
        if step.phase is not None:
            s.clock.add(step.phase, time.perf_counter() - started)


def _rank_main(rank: int, world: int, cfg: OnPolicyConfig, python: str, root: str, vocab: int) -> OnPolicyRun | None:
    """One rank of the loop (module docstring). Rank 0 returns the run's record."""
    from fx_precision.checkpoints import stored_tensors
    from fx_precision.ranks import cpu_mesh

    torch.set_num_threads(max(1, int(os.environ.get("FXP_TRAINER_THREADS", "1"))))
    described = {"task": cfg.training.task.describe(), "prompts": None if cfg.sampling.prompts is None else len(cfg.sampling.prompts)}
    record = OnPolicyRun(cfg.to_record() | described, None, None, [])
    r = Rank(rank, world, cfg, vocab, Path(root), [t.name for t in stored_tensors(cfg.checkpoint)], cpu_mesh(world), record)
    try:
        r.engine = _start_engine(r, python)
        for step in range(cfg.steps):
            state = StepState(step)
            run_step(r, state)
            if state.stop is not None:
                record.stopped = state.stop
                break
    finally:
        if r.engine is not None:
            r.engine.close()
    return record if rank == 0 else None


def _start_engine(r: Rank, python: str) -> EngineSide | None:
    """Rank 0 starts the engine, the others None; a failure reaches every rank as one PrecisionError."""
    from fx_precision.onpolicy.engine_side import EngineSide

    made, error = None, None
    if r.lead:
        try:
            made = EngineSide(r.cfg, python, r.root, r.vocab)
        except PrecisionError as exc:
            error = str(exc)
    error = _broadcast(error)
    if error is not None:
        raise PrecisionError(error)
    return made
