"""The training side against a real engine's dump: the same checkpoint, the engine's token ids, as a dump.

train_against(engine_dump, TrainConfig(checkpoint, policy, contract, world_size, compiled))
├── load the checkpoint as fp32 masters (they hold its bf16 values exactly, as after a weight sync)
├── policy: as given (gather, compute, rules), or the engine contract's (gather bf16, compute bf16,
│   and the contract's graph rewrites in the backend)
├── run each of the dump's sequences alone (batch 1, call i = sequence i), teacher-forced over
│   prompt + generated tokens: in process (eager, gathers emulated at use), compiled with
│   precision_backend (Inductor, or aot_eager), or under FSDP2 on N gloo ranks (rank 0 records)
└── record: fp32 log_softmax of the bf16 logits at each next token (what the engine's sampler
    returns), and with --modules on the engine side every module's inputs and outputs, so the
    comparator finds the first module and op where the two part
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fx_precision.compare import next_token_logprobs
from fx_precision.dump import Dump, DumpRecorder, Sequence
from fx_precision.errors import PrecisionError
from fx_precision.tools.census_driver import CensusConfig


@dataclass(frozen=True)
class TrainConfig:
    checkpoint: str
    policy: CensusConfig  # gather / compute / master / rules, as the census driver reads them
    contract: bool = False  # follow the engine contract the dump recorded
    world_size: int = 0  # 0: in process; N: FSDP2 on N gloo ranks
    compiled: bool = False
    inner: str = "inductor"  # the backend's inner compiler when compiled
    modules: bool = True  # record module inputs and outputs (eager, in process)


def _policy(cfg: TrainConfig, model: nn.Module, dump: Dump) -> Any:
    policy = cfg.policy.policy(model)
    if cfg.contract:
        from fx_precision.contract import contract_of_dump

        contract = contract_of_dump(dump)
        policy = replace(policy, gather=torch.bfloat16, compute=torch.bfloat16, cast_forward_inputs=False, contract=contract)
    return policy


def _engine_rows(dump: Dump, policy: Any, steps: str = "steps") -> list[Any]:
    """Each sequence's engine rows (batch 1), when the policy follows a contract: the rows of the engine call that
    computed each row, and the contract's linear orders. ``steps``: the generation's forwards (``steps``), or the
    module pass's (``module_steps``: each sequence prefilled alone; its logits are not compared)."""
    contract = getattr(policy, "contract", None)
    if contract is None:
        return [None] * len(dump.sequences)
    from fx_precision.contract.batch_rows import EngineRows, RowPlan, row_plans

    engine = dump.engine or {}
    if steps == "steps":
        plans = row_plans(dump.sequences, engine)
    else:
        module_pass = {"steps": engine.get(steps), "logits_calls": engine.get("module_logits_calls")}
        alone = row_plans(dump.sequences, module_pass, with_logits=False)
        plans = [RowPlan(p.body, (0,) * len(p.logits)) for p in alone]
    return [EngineRows.of([plan], contract.linears) for plan in plans]


def _forward_all(model: Any, dump: Dump, policy: Any, out: Dump, rows: list[Any]) -> None:
    """Each sequence alone. Compiled, each length is a graph of its own (static shapes): Dynamo may
    compile as many as it needs, and fails rather than run a frame eagerly (without the pass) past its limit."""
    import torch._dynamo

    limits = torch._dynamo.config.patch(recompile_limit=max(64, 4 * len(dump.sequences)), fail_on_recompile_limit_hit=True)
    with limits:
        _forward_each(model, dump, policy, out, rows)


def _forward_each(model: Any, dump: Dump, policy: Any, out: Dump, rows: list[Any]) -> None:
    from fx_precision.contract.batch_rows import engine_rows

    for sequence, plan in zip(dump.sequences, rows, strict=True):
        tokens = torch.tensor([sequence.tokens])
        context = engine_rows(plan) if plan is not None else contextlib.nullcontext()
        with torch.no_grad(), policy.forward_context("cpu"), context:
            logits = _logits(model(input_ids=tokens, use_cache=False))
        out.add_logprobs(Sequence(sequence.tokens, sequence.prompt_len), next_token_logprobs(logits, tokens)[0])


def _logits(output: Any) -> torch.Tensor:
    from fx_precision.tools.zoo import logits_of

    return logits_of(output)


def train_against(dump: Dump, cfg: TrainConfig) -> Dump:
    """Record the training side on ``dump``'s sequences (see the module docstring)."""
    if not dump.sequences:
        raise PrecisionError(f"dump {dump.source} holds no token sequences; an engine dump (fx-precision rollout) does")
    if cfg.world_size > 0:
        from fx_precision.tools.distributed import run_on_ranks

        _check_weights(cfg.checkpoint, dump)
        slim = replace(dump, records=[], calls=[], replays={})  # what a rank reads: sequences, steps, contract (not the records)
        return run_on_ranks(_train_on_rank, cfg.world_size, slim, cfg)[0]
    from fx_precision.fsdp import gathered_eagerly
    from fx_precision.tools.checkpoint import load_checkpoint

    _check_weights(cfg.checkpoint, dump)
    model = load_checkpoint(cfg.checkpoint, dtype=torch.float32)
    _check_vocabulary(model, dump)
    policy = _policy(cfg, model, dump)
    plan = policy.plan(model)
    out = Dump(type(model).__name__, inputs=cfg.modules and not compiles(cfg), contract=dump.contract if cfg.contract else None)
    if compiles(cfg):  # the contract is a graph rewrite: "eager" under it is the pass with aot_eager
        from fx_precision.backend import make_precision_backend

        inner = cfg.inner if cfg.compiled else "aot_eager"
        backend = make_precision_backend(policy=policy, plan=plan, inner=inner)
        compiled = torch.compile(model, backend=backend, dynamic=False)
        _forward_all(compiled, dump, policy, out, _engine_rows(dump, policy))
        rewrites = {name: n for r in backend.reports for name, n in r.rewrites.items() if n}
        out.source = f"train, compiled with precision_backend ({inner}; {policy.describe()}; rewrites {rewrites or 'none'})"
        if cfg.modules and cfg.contract and _has_module_records(dump):
            _record_modules_under_contract(model, dump, policy, plan, inner, out)
        return out
    with gathered_eagerly(model, plan):
        if cfg.modules:
            with DumpRecorder(model, inputs=True, replay=True) as recorder:
                _forward_all(model, dump, policy, out, _engine_rows(dump, policy))
            out.records = recorder.dump.records + out.records
            out.calls, out.replays, out.autocast = recorder.dump.calls, recorder.dump.replays, recorder.dump.autocast
        else:
            _forward_all(model, dump, policy, out, _engine_rows(dump, policy))
    out.source = f"train, eager ({policy.describe()})"
    return out


def _has_module_records(dump: Dump) -> bool:
    return bool((dump.engine or {}).get("module_steps")) and any(r.io in ("in", "out") and r.fqn for r in dump.records)


def _record_modules_under_contract(model: nn.Module, dump: Dump, policy: Any, plan: Any, inner: str, out: Dump) -> None:
    """The module records of the training side under the contract, for the comparator's origins: the same compiled
    graphs with taps (graph_taps.py), each sequence alone on the rows of the engine's module pass (each sequence
    prefilled alone: the batch its module records were computed in); and, on demand, a module run alone under the
    contract on the engine's recorded inputs (the comparator's first differing op)."""
    import torch._dynamo

    from fx_precision.backend import make_precision_backend
    from fx_precision.graph_taps import TapRecorder

    names = {r.fqn for r in dump.records if r.io in ("in", "out")}
    rows = _engine_rows(dump, policy, steps="module_steps")
    torch._dynamo.reset()  # the hooks are part of what Dynamo traces: fresh graphs, with taps
    backend = make_precision_backend(policy=policy, plan=plan, inner=inner)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    tapped = Dump(type(model).__name__)
    with TapRecorder(model, only=names) as taps:
        _forward_all(compiled, dump, policy, tapped, rows)
    torch._dynamo.reset()
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


def compiles(cfg: TrainConfig) -> bool:
    return cfg.compiled or cfg.contract


def _check_weights(checkpoint: str, dump: Dump) -> None:
    from fx_precision.tools.checkpoint import weights_fingerprint

    recorded = (dump.engine or {}).get("weights")
    if recorded and recorded != weights_fingerprint(checkpoint):
        raise PrecisionError(
            f"dump {dump.source} was made from other weights than {checkpoint} (fingerprint {recorded} vs "
            f"{weights_fingerprint(checkpoint)}): pass the checkpoint the engine ran ({(dump.engine or {}).get('checkpoint')})"
        )


def _check_vocabulary(model: nn.Module, dump: Dump) -> None:
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    top = max(max(s.tokens) for s in dump.sequences)
    if vocab and top >= vocab:
        raise PrecisionError(
            f"dump {dump.source} holds token id {top}, outside the checkpoint's vocabulary of {vocab}: the dump is of another model"
        )
    if dump.model and dump.model != type(model).__name__:
        raise PrecisionError(
            f"dump {dump.source} is of {dump.model}, the checkpoint builds {type(model).__name__}: pass the checkpoint the engine ran"
        )


def _train_on_rank(rank: int, world_size: int, dump: Dump, cfg: TrainConfig) -> Dump:
    """Inside a gloo rank: the checkpoint under FSDP2 (per-layer units, the policy's plan), every rank
    on the same sequences; rank 0's log-probs are the side's."""
    from fx_precision.fsdp import apply_fsdp2, layer_wrap_globs
    from fx_precision.tools.checkpoint import load_checkpoint
    from fx_precision.tools.distributed import cpu_mesh

    torch.set_num_threads(1)
    model = load_checkpoint(cfg.checkpoint, dtype=torch.float32)
    _check_vocabulary(model, dump)
    policy = _policy(cfg, model, dump)
    plan = policy.plan(model, wrap=layer_wrap_globs(model))
    name = type(model).__name__  # before FSDP2 makes it FSDP<name>
    apply_fsdp2(model, plan, mesh=cpu_mesh(world_size), policy=policy)
    forward: Any = model
    if compiles(cfg):
        from fx_precision.backend import make_precision_backend

        inner = cfg.inner if cfg.compiled else "aot_eager"
        forward = torch.compile(model, backend=make_precision_backend(policy=policy, plan=plan, inner=inner), dynamic=False)
    out = Dump(name, rank=rank, world_size=world_size, contract=dump.contract if cfg.contract else None)
    _forward_all(forward, dump, policy, out, _engine_rows(dump, policy))
    how = f", compiled ({cfg.inner})" if cfg.compiled else (", the pass with aot_eager" if compiles(cfg) else "")
    out.source = f"train, FSDP2 on {world_size} gloo ranks{how} ({policy.describe()})"
    return out
