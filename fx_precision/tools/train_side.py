"""The training side against a real engine's dump: the same checkpoint, the engine's token ids, as a dump.

train_against(engine_dump, RunConfig(checkpoint, policy=PolicyFlags(...), contract=..., compiled=..., world_size=...))
├── the training side (fx_precision/training_side.py; its RunConfig the one the CLI built, the eager fix's example ids
│   the dump's first sequence: side_for_dump); against_engine_dump sets the contract the dump recorded: the checkpoint as fp32
│   masters (they hold its bf16 values exactly, as after a weight sync); the policy as given (gather, compute,
│   rules, the eager fix), or the engine contract's (gather bf16, compute bf16, and the contract's graph rewrites in
│   the backend)
├── run each of the dump's sequences alone (batch 1, call i = sequence i), teacher-forced over
│   prompt + generated tokens: in process (eager, gathers emulated at use), compiled with
│   precision_backend (Inductor, or aot_eager), or under FSDP2 on N gloo ranks (rank 0 records)
├── an MoE engine dump: every forward's routes tapped (routes.RouteTap), or replayed (``cfg.replay_routes``: each token
│   on the engine's experts), and compared per layer with the engine's (``Dump.routes``: EngineRoutes.report)
└── record: the log-prob of each next token as the engine's sampler returned it (fx_precision/logprobs.py:
    raw, or processed at the dump's temperature), and with --modules on the engine side every module's inputs and outputs, so the
    comparator finds the first module and op where the two part
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from fx_precision.contract.vocabulary import OpClass
from fx_precision.dtypes import dtype_name
from fx_precision.dump import Dump, DumpRecorder, Sequence
from fx_precision.errors import PrecisionError
from fx_precision.logprobs import LogprobForm, token_logprobs
from fx_precision.policy_flags import PolicyFlags
from fx_precision.routes import MoeSpec, RouteTap, disagreement, refuse_moe_contract, routes_of
from fx_precision.tools.compare_sides import CompareSides
from fx_precision.training_side import RunConfig, TrainingSide, build_training_side, compile_limits


def side_for_dump(cfg: RunConfig, dump: Dump) -> RunConfig:
    """``cfg`` on ``dump``'s sequences: the eager fix (where asked) derived on the dump's first sequence."""
    if cfg.eager_fix and dump.sequences:
        return replace(cfg, example_ids=torch.tensor([dump.sequences[0].tokens]))
    return cfg


def _engine_rows(dump: Dump, policy: Any, steps: str = "steps") -> list[Any]:
    """Each sequence's engine rows (batch 1), when the policy follows a contract: the rows of the engine call that
    computed each row, and the contract's linear orders. ``steps``: the generation's forwards (``steps``), or the
    module pass's (``module_steps``: each sequence prefilled alone; its logits are not compared)."""
    contract = getattr(policy, "contract", None)
    if contract is None:
        return [None] * len(dump.sequences)
    from fx_precision.contract.batch_rows import EngineRows, row_plans

    engine = dump.engine or {}
    if steps == "steps":
        plans = row_plans(dump.sequences, engine, tiling=contract.kv_tiling, gdn=contract.gdn is not None)
    else:
        module_pass = {"steps": engine.get(steps), "logits_calls": engine.get("module_logits_calls")}
        alone = row_plans(dump.sequences, module_pass, with_logits=False, tiling=contract.kv_tiling, gdn=contract.gdn is not None)
        plans = [replace(p, logits=(0,) * len(p.logits), logits_at=None) for p in alone]
    return [EngineRows.of([plan], contract.linears) for plan in plans]


def _forward_all(side: TrainingSide, dump: Dump, out: Dump, rows: list[Any]) -> None:
    """Each sequence alone. Compiled, each length is a graph of its own (static shapes). Against an MoE engine dump, the
    routes each forward took are tapped, or replayed (``cfg.replay_routes``), and compared with the engine's (``out.routes``)."""
    routing = EngineRoutes.of(dump, side.cfg.replay_routes, under_contract=side.cfg.contract is not None)
    with compile_limits(4 * len(dump.sequences)):
        _forward_each(side, dump, out, rows, routing)
    if routing is not None:
        out.routes = routing.report()


@dataclass
class EngineRoutes:
    """An MoE engine dump's routes per sequence (routes.routes_of), whether the training side replays them, and the routes
    each of its forwards took."""

    spec: MoeSpec
    engine: list[torch.Tensor] | None  # None: the dump holds none (``why``)
    replay: bool
    why: str | None = None
    under_contract: bool = False  # the contract's router op routes (and reports) instead of the model's top-k
    used: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, dump: Dump, replay: bool, *, under_contract: bool = False) -> EngineRoutes | None:
        engine = dump.engine or {}
        spec = MoeSpec.of(engine)
        if spec is None:
            if replay:
                raise PrecisionError(f"--replay-routes: the engine dump {dump.source} records no mixture-of-experts routes (a dense model)")
            return None
        if engine.get("routes") is None:
            why = str(engine.get("routes_missing") or "the dump records none (written by an older rollout)")
            if replay:
                raise PrecisionError(f"--replay-routes: the engine's routes were not recorded whole ({why}); roll out again")
            return cls(spec, None, False, why, under_contract)
        return cls(spec, routes_of(dump.sequences, engine), replay, None, under_contract)

    def tap(self, sequence: int) -> RouteTap:
        replay = self.engine[sequence] if self.replay and self.engine is not None else None
        return RouteTap(self.spec, replay=replay, intercept=not self.under_contract)

    def keep(self, tap: RouteTap, length: int) -> None:
        tap.check_complete()
        self.used.append(torch.stack([u.reshape(length, self.spec.top_k) for u in tap.used]).cpu())

    def report(self) -> dict[str, Any]:
        """Per MoE layer, the share of the engine's routed tokens the training side routed to another set of experts."""
        layers = disagreement(self.spec, self.engine, self.used) if self.engine is not None else None
        how = "contract" if self.under_contract else "replayed" if self.replay else "own"
        return {"replayed": self.replay, "routed_by": how, "moe": self.spec.to_dict(), "layers": layers, "why": self.why}


@dataclass(frozen=True)
class EngineLogprobs:
    """The log-probs an engine returned: their form (its contract's, else its recorded mode) and the sampler's
    processing they went through (temperature, top-k, top-p; logprobs.py)."""

    form: LogprobForm
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def engine_logprobs(dump: Dump, policy: Any) -> EngineLogprobs:
    """The log-probs ``dump``'s engine returned (EngineLogprobs)."""
    engine = dump.engine or {}
    contract = getattr(policy, "contract", None)
    form = contract.logprob_form() if contract is not None else LogprobForm(str(engine.get("logprobs", "raw")))
    return EngineLogprobs(form, float(engine.get("temperature", 1.0)), int(engine.get("top_k", 0)), float(engine.get("top_p", 1.0)))


def _forward_each(side: TrainingSide, dump: Dump, out: Dump, rows: list[Any], routing: EngineRoutes | None = None) -> None:
    lps = engine_logprobs(dump, side.policy)
    for i, (sequence, plan) in enumerate(zip(dump.sequences, rows, strict=True)):
        tokens = torch.tensor([sequence.tokens])
        tap = routing.tap(i) if routing is not None else contextlib.nullcontext()
        with torch.no_grad(), tap:
            logits = side.logits(tokens, plan)
        if routing is not None:
            routing.keep(tap, len(sequence.tokens))  # type: ignore[arg-type]
        lp = token_logprobs(logits, tokens, lps.form, lps.temperature, [sequence.prompt_len], lps.top_k, lps.top_p)[0]
        out.add_logprobs(Sequence(sequence.tokens, sequence.prompt_len), lp)


@dataclass
class EngineRun:
    """The training side against an engine dump: both dumps, the contract it followed (or None), what it does not follow."""

    train: Dump
    engine: Dump
    contract: Any
    notes: list[str]

    def sides(self) -> CompareSides:
        """As compare reads them (tools/compare_sides.CompareSides): a the training side, b the engine."""
        head = f"a: {self.train.source}\nb: {self.engine.source} ({(self.engine.engine or {}).get('kernels', '')})"
        if self.contract is not None:
            head += f"\ncontract: {self.contract.describe()}" + "".join(f"\n{note}" for note in self.notes)
        return CompareSides(self.train, self.engine, head, self.notes, self.train.routes)


def against_engine_dump(path: str, cfg: RunConfig, *, contract_engine: str | None = None, follow: bool | None = None) -> EngineRun:
    """Read the engine dump at ``path`` against itself (``check_engine_dump``), hold the contract to its evidence where one
    is followed (``contract_engine``: the engine it must be the contract of; ``follow``: the dump's contract whatever its
    engine, default: where ``contract_engine`` is given), and run the training side on its sequences under it."""
    from fx_precision.contract import contract_notes, contract_of_dump
    from fx_precision.contract.attention_tiles import longest_row
    from fx_precision.dump import check_engine_dump, load_dump
    from fx_precision.engine_description import EngineDescription
    from fx_precision.tools.zoo import is_checkpoint_path

    if not isinstance(cfg.model, str) or not is_checkpoint_path(cfg.model):
        raise PrecisionError(
            f"--rollout {path} is an engine dump: --model must be the checkpoint directory the engine ran, got {cfg.model!r}"
        )
    engine = load_dump(path)
    if isinstance(engine, dict):
        raise PrecisionError(f"--rollout {path}: one dump per rank; an engine dump of this version is one directory")
    check_engine_dump(engine)
    contract, notes = None, []
    if follow if follow is not None else contract_engine is not None:
        contract = contract_of_dump(engine)
        if contract_engine is not None and contract.engine != contract_engine:
            raise PrecisionError(
                f"--contract {contract_engine}: the dump holds {contract.engine}'s contract; pass --contract {contract.engine}"
            )
        notes = contract_notes(contract, EngineDescription.of_run(engine.engine), longest_row(engine.engine or {}))
        if contract.moe is None:
            refuse_moe_contract(engine.engine or {}, f"--contract {contract.engine}", contract.why_unmatched().get(OpClass.MOE))
        if cfg.replay_routes:
            raise PrecisionError("--replay-routes with --contract: the contract routes every token as the engine does; drop one")
        if contract.inductor is not None:  # refused before any model is built (the backend checks it again on every graph)
            from fx_precision.backend import check_compiled_engine

            check_compiled_engine(contract.inductor, cfg.inner_compiler(), cfg.world_size, norm_orders=contract.norm_reductions is not None)
    return EngineRun(train_against(engine, replace(cfg, contract=contract)), engine, contract, notes)


def first_origin(checkpoint: str, rollout: str, *, contract: bool) -> dict[str, Any]:
    """Where the training side (eager, in process; under the dump's contract, or as users run it) parts from an engine
    dump that holds module records: the comparator's first origin module and its first differing op (what the
    on-policy loop's strict mode reports on the step it stopped at)."""
    from fx_precision.compare import compare
    from fx_precision.routes import moe_origin

    run = against_engine_dump(rollout, RunConfig(checkpoint, policy=PolicyFlags()), follow=contract)
    result = compare(run.train, run.engine)
    origin, op = result.first_origin, result.first_op
    moe = moe_origin(origin.fqn, origin.call, origin.worst_output, run.train.routes) if origin and run.train.routes else None
    return {"module": origin.fqn if origin else None, "op": op.op_a if op else None, "explanation": op.explanation if op else None,
            "moe": moe}  # fmt: skip


def name_first_origin(run: Any, *, contract: bool) -> None:
    """An on-policy run that stopped (fx_precision/onpolicy): the comparator on the step it stopped at, whose
    checkpoint and rollout (with module records) its directory keeps; its first origin joins the run's stop line."""
    last = os.path.join(run.out, "last")
    run.origin = first_origin(os.path.join(last, "checkpoint"), os.path.join(last, "rollout"), contract=contract)
    run.stopped += f"; first origin: {run.origin['module']} (op {run.origin['op']})"


def train_against(dump: Dump, cfg: RunConfig) -> Dump:
    """Record the training side on ``dump``'s sequences (see the module docstring), under ``cfg.contract`` where one is
    given (the dump's own: ``contract_of_dump``)."""
    if not dump.sequences:
        raise PrecisionError(f"dump {dump.source} holds no token sequences; an engine dump (fx-precision rollout) does")
    if not isinstance(cfg.model, str):
        raise PrecisionError("the training side against an engine dump loads the checkpoint the engine ran: RunConfig(model=its directory)")
    if cfg.world_size > 0:
        from fx_precision.ranks import run_on_ranks

        layout = _check_weights(cfg.model, dump)
        slim = replace(dump, records=[], calls=[], replays={})  # what a rank reads: sequences, steps, contract (not the records)
        return run_on_ranks(_train_on_rank, cfg.world_size, slim, cfg, layout)[0]
    layout = _check_weights(cfg.model, dump)
    side = build_training_side(side_for_dump(cfg, dump))
    _check_vocabulary(side, dump, layout)
    followed = dump.contract if cfg.contract is not None else None
    out = Dump(layout or side.name, inputs=cfg.record_inputs and not side.cfg.compiles(), contract=followed)  # the engine's
    # architecture where the checkpoint is its weights in another layout: the same model, so the comparator pairs them
    rows = _engine_rows(dump, side.policy)
    if side.cfg.compiles():
        _forward_all(side, dump, out, rows)
        out.source = f"{side.describe()}; rewrites {side.rewrites() or 'none'}"
        if cfg.record_inputs and cfg.contract is not None and _has_module_records(dump):
            _record_modules_under_contract(side, dump, out)
        return out
    if cfg.record_inputs:
        with DumpRecorder(side.model, inputs=True, replay=True) as recorder:
            _forward_all(side, dump, out, rows)
        out.records = recorder.dump.records + out.records
        out.calls, out.replays = recorder.dump.calls, recorder.dump.replays
        out.autocast = dtype_name(side.policy.compute) if side.policy.compute is not None else None  # what the replays run under
    else:
        _forward_all(side, dump, out, rows)
    out.source = side.describe()
    return out


def _has_module_records(dump: Dump) -> bool:
    return bool((dump.engine or {}).get("module_steps")) and any(r.io in ("in", "out") and r.fqn for r in dump.records)


def _record_modules_under_contract(side: TrainingSide, dump: Dump, out: Dump) -> None:
    """The module records of the training side under the contract, for the comparator's origins: the same compiled
    graphs with taps (graph_taps.py), each sequence alone on the rows of the engine's module pass (each sequence
    prefilled alone: the batch its module records were computed in); and, on demand, a module run alone under the
    contract on the engine's recorded inputs (the comparator's first differing op)."""
    from fx_precision.graph_taps import TapRecorder
    from fx_precision.training_side import _compile

    model, policy, plan = side.model, side.policy, side.plan
    names = {r.fqn for r in dump.records if r.io in ("in", "out")}
    rows = _engine_rows(dump, policy, steps="module_steps")
    # the hooks are part of what Dynamo traces: the built side compiled again by a backend of its own, whose graphs Dynamo
    # traces afresh, with the taps (a compiled frame is kept per backend: the side's own graphs, and the caller's, stay)
    tapped_side = copy.copy(side)  # the fields the steps set are not init fields
    tapped_side.backend = None
    tapped_side = _compile(tapped_side)
    tapped = Dump(side.name)
    with TapRecorder(model, only=names) as taps, compile_limits(8 * len(dump.sequences)):
        _forward_all(tapped_side, dump, tapped, rows)
    out.records = taps.dump.records + out.records
    out.calls = taps.dump.calls
    out.inputs = True
    out.replays = ContractReplays(model, dump, policy, plan, rows)  # type: ignore[assignment]


class ContractReplay:
    """One module run alone under the contract: compiled with the contract's backend, its rewritten graph run op by
    op (so the comparator's op recorder sees each op, the contract's custom ops among them), on the rows of the
    sequence its call was."""

    def __init__(self, module: nn.Module, policy: Any, plan: Any, rows: Any) -> None:
        from fx_precision.backend import make_precision_backend

        self.policy, self.rows = policy, rows
        self.compiled = torch.compile(module, backend=make_precision_backend(policy=policy, plan=plan, inner=_run_graph), dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._python_dispatch import _disable_current_modes

        from fx_precision.contract.batch_rows import engine_rows

        with engine_rows(self.rows), self.policy.forward_context("cpu"):
            with _disable_current_modes():  # Dynamo compiles outside any dispatch mode: compile first, then run in it
                self.compiled(*args, **kwargs)
            return self.compiled(*args, **kwargs)


def _run_graph(gm: Any, example_inputs: list[Any]) -> Any:
    return gm


class ContractReplays:
    """``Dump.replays`` of the training side under the contract, made when the comparator asks for one: the model's
    call of that module in an eager pass of the sequence (its arguments' structure; the comparator puts the
    engine's recorded tensors in), and the module as a ContractReplay."""

    def __init__(self, model: nn.Module, dump: Dump, policy: Any, plan: Any, rows: list[Any]) -> None:
        self.model, self.dump, self.policy, self.plan, self.rows = model, dump, policy, plan, rows
        self.names = {name for name, _ in model.named_modules()}

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2 and key[0] in self.names and 0 <= key[1] < len(self.dump.sequences)

    def __getitem__(self, key: tuple[str, int]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        from fx_precision.fsdp import gathered_eagerly

        fqn, call = key
        sequence = self.dump.sequences[call]
        tokens = torch.tensor([sequence.tokens])
        with torch.no_grad(), gathered_eagerly(self.model, self.plan), self.policy.forward_context("cpu"):
            with DumpRecorder(self.model, replay=True) as recorder:
                self.model(input_ids=tokens, use_cache=False)
        module, args, kwargs = recorder.dump.replays[(fqn, 0)]
        return ContractReplay(module, self.policy, self.plan, self.rows[call]), args, kwargs

    def items(self) -> list[Any]:
        return []


def _check_weights(checkpoint: str, dump: Dump) -> str | None:
    """The checkpoint is the one the engine ran: the digest of every byte of every tensor must be the dump's, or that of
    the same weights in the layout the engine ran them in (a Qwen3.5-MoE checkpoint as Qwen3-Next: tools/gdn_layout.py).
    Returns the architecture the engine ran where it is the other layout's, else None."""
    from fx_precision.checkpoints import weights_digest
    from fx_precision.tools.gdn_layout import RELAID_ARCHITECTURE, relaid_digest

    recorded = (dump.engine or {}).get("weights")
    if not isinstance(recorded, str) or not recorded.startswith("sha256:"):
        raise PrecisionError(
            f"dump {dump.source} records no weights digest (engine.weights): nothing ties it to a checkpoint, so a comparison "
            "could blame the engine for other weights. Roll out again with fx-precision rollout of this version"
        )
    mine = weights_digest(checkpoint)
    if recorded == mine:
        return None
    if dump.model == RELAID_ARCHITECTURE and relaid_digest(checkpoint) == recorded:
        return RELAID_ARCHITECTURE
    raise PrecisionError(
        f"dump {dump.source} was made from other weights than {checkpoint} (digest {recorded[:23]}... vs {mine[:23]}...): pass the "
        f"checkpoint the engine ran ({(dump.engine or {}).get('checkpoint')})"
    )


def _check_vocabulary(side: TrainingSide, dump: Dump, engine_architecture: str | None = None) -> None:
    """The dump's token ids fit the model, and the engine ran this architecture (or ``engine_architecture``: the same
    weights laid out as another, ``_check_weights``)."""
    model = side.model
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    top = max(max(s.tokens) for s in dump.sequences)
    if vocab and top >= vocab:
        raise PrecisionError(
            f"dump {dump.source} holds token id {top}, outside the checkpoint's vocabulary of {vocab}: the dump is of another model"
        )
    if dump.model and dump.model not in (side.name, engine_architecture):
        raise PrecisionError(
            f"dump {dump.source} is of {dump.model}, the checkpoint builds {side.name}: pass the checkpoint the engine ran"
        )


def _train_on_rank(rank: int, world_size: int, dump: Dump, cfg: RunConfig, layout: str | None = None) -> Dump:
    """Inside a gloo rank: the checkpoint under FSDP2 (per-layer units, the policy's plan), every rank
    on the same sequences; rank 0's log-probs are the side's (``layout``: ``_check_weights``'s)."""
    from fx_precision.ranks import cpu_mesh

    torch.set_num_threads(1)
    side = build_training_side(side_for_dump(cfg, dump), mesh=cpu_mesh(world_size, cfg.mesh))
    _check_vocabulary(side, dump, layout)
    out = Dump(layout or side.name, rank=rank, world_size=world_size, contract=dump.contract if cfg.contract is not None else None)
    _forward_all(side, dump, out, _engine_rows(dump, side.policy))
    out.source = side.describe()
    return out
