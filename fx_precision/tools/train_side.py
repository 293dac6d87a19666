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


def _row_plans(dump: Dump, policy: Any) -> list[Any]:
    """The engine's small-batch rows of each sequence, when the contract says its linears switch kernels."""
    contract = getattr(policy, "contract", None)
    if contract is None or not contract.small_batch_rows:
        return [None] * len(dump.sequences)
    from fx_precision.contract.batch_rows import row_plans

    return row_plans(dump.sequences, dump.engine or {}, contract.small_batch_rows)


def _forward_all(model: Any, dump: Dump, policy: Any, out: Dump, record: Any) -> None:
    """Each sequence alone. Compiled, each length is a graph of its own (static shapes): Dynamo may
    compile as many as it needs, and fails rather than run a frame eagerly (without the pass) past its limit."""
    import torch._dynamo

    limits = torch._dynamo.config.patch(recompile_limit=max(64, 4 * len(dump.sequences)), fail_on_recompile_limit_hit=True)
    with limits:
        _forward_each(model, dump, policy, out, record)


def _forward_each(model: Any, dump: Dump, policy: Any, out: Dump, record: Any) -> None:
    from fx_precision.contract.ops import engine_rows

    for sequence, plan in zip(dump.sequences, _row_plans(dump, policy), strict=True):
        tokens = torch.tensor([sequence.tokens])
        rows = engine_rows(*plan.tensors()) if plan is not None else contextlib.nullcontext()
        with torch.no_grad(), policy.forward_context("cpu"), rows:
            logits = _logits(model(input_ids=tokens, use_cache=False))
        out.add_logprobs(Sequence(sequence.tokens, sequence.prompt_len), next_token_logprobs(logits, tokens)[0])
        if record is not None:
            record(tokens, logits)


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
        return run_on_ranks(_train_on_rank, cfg.world_size, dump, cfg)[0]
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
        _forward_all(compiled, dump, policy, out, None)
        rewrites = {name: n for r in backend.reports for name, n in r.rewrites.items() if n}
        out.source = f"train, compiled with precision_backend ({inner}; {policy.describe()}; rewrites {rewrites or 'none'})"
        return out
    with gathered_eagerly(model, plan):
        if cfg.modules:
            with DumpRecorder(model, inputs=True, replay=True) as recorder:
                _forward_all(model, dump, policy, out, None)
            out.records = recorder.dump.records + out.records
            out.calls, out.replays, out.autocast = recorder.dump.calls, recorder.dump.replays, recorder.dump.autocast
        else:
            _forward_all(model, dump, policy, out, None)
    out.source = f"train, eager ({policy.describe()})"
    return out


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
    _forward_all(forward, dump, policy, out, None)
    how = f", compiled ({cfg.inner})" if cfg.compiled else (", the pass with aot_eager" if compiles(cfg) else "")
    out.source = f"train, FSDP2 on {world_size} gloo ranks{how} ({policy.describe()})"
    return out
