"""Built-in sides for ``fx-precision dump`` and ``compare``: a training policy and a bf16 rollout stand-in.

    train side     the model's fp32 masters, rounded to bf16 first (as after loading a bf16
                   checkpoint), under a policy: gather (emulated at use on one device, or FSDP2 on
                   N gloo ranks), compute (autocast), rules; eager, or compiled with precision_backend
    rollout bf16   the same weights (parameters) cast to bf16, eager, no autocast: a stand-in for an inference
                   engine (sglang / vLLM run the bf16 checkpoint), not the engine itself
    rollout DIR    a dump written anywhere (an engine's own process, another machine)

Both sides see the same token ids. In-process sides keep replays (op-level drill-down); a side on
gloo ranks or compiled records what it can (module calls on ranks; only the logits when compiled).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fx_precision.dump import Dump, DumpRecorder, Record
from fx_precision.eager_fix import eager_casts
from fx_precision.errors import PrecisionError
from fx_precision.logprobs import logits_of
from fx_precision.out_dirs import replace_dir
from fx_precision.ranks import launched, launcher_rank
from fx_precision.tools.census_driver import CensusConfig
from fx_precision.tools.zoo import build_model, forward_kwargs, token_batch


@dataclass(frozen=True)
class SideConfig:
    """A training side: the census driver's policy knobs, plus how it runs."""

    policy: CensusConfig
    world_size: int = 0  # 0: in-process, no FSDP2; N: FSDP2 on N gloo ranks
    compiled: bool = False
    inputs: bool = True


def shared_model(name: str, seed: int = 0) -> nn.Module:
    """The model both sides start from: fp32 masters rounded to bf16-representable values."""
    model = build_model(name, seed=seed, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


def run_forward(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)``; a failure of the model's own code is one PrecisionError line."""
    try:
        return model(*args, **kwargs)
    except PrecisionError:
        raise
    except Exception as exc:  # the user's model: its failure, said in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise PrecisionError(f"the forward of {type(model).__name__} raised {type(exc).__name__}: {first[:400]}") from exc


def _ids(model: nn.Module, cfg: CensusConfig) -> torch.Tensor:
    return token_batch(model, batch=cfg.batch, seq_len=cfg.seq_len, seed=cfg.seed + 1)


def train_dump(side: SideConfig) -> Dump:
    """Record the training side (see the module docstring)."""
    if side.world_size > 0:
        from fx_precision.ranks import run_on_ranks

        dumps = run_on_ranks(_train_on_rank, side.world_size, side, None)
        return dumps[0]
    return _train_in_process(side)


def _train_in_process(side: SideConfig) -> Dump:
    from fx_precision.fsdp import gathered_eagerly

    cfg = side.policy
    model = shared_model(cfg.model, cfg.seed)
    policy = cfg.policy(model)
    plan = policy.plan(model)
    ids = _ids(model, cfg)
    kwargs = forward_kwargs(model)
    fix = eager_casts(model, ids, policy=policy, plan=plan, **kwargs).apply(model) if cfg.eager_fix and not side.compiled else None
    if side.compiled:
        from fx_precision.backend import make_precision_backend

        compiled = torch.compile(model, backend=make_precision_backend(policy=policy, plan=plan))
        with torch.no_grad(), policy.forward_context("cpu"):
            logits = logits_of(run_forward(compiled, ids, **kwargs))
        return _root_only(model, ids, logits, policy.compute)
    with torch.no_grad(), gathered_eagerly(model, plan), policy.forward_context("cpu"):
        with DumpRecorder(model, inputs=side.inputs, replay=True) as recorder:
            run_forward(model, ids, **kwargs)
    recorder.dump.source = f"train ({policy.describe()}{', eager fix: ' + str(len(fix.hooks)) + ' hook(s)' if fix else ''})"
    return recorder.dump


def _root_only(model: nn.Module, ids: torch.Tensor, logits: torch.Tensor, compute: torch.dtype | None) -> Dump:
    from fx_precision.dtypes import dtype_name
    from fx_precision.dump import CallInfo

    dump = Dump(type(model).__name__, autocast=dtype_name(compute) if compute else None, source="train (compiled: logits only)")
    dump.calls.append(CallInfo("", 0, 1, 2))
    dump.records.append(Record("", 0, "in", "args[0]", dtype_name(ids.dtype), tuple(ids.shape), ids.clone()))
    dump.records.append(Record("", 0, "out", "out", dtype_name(logits.dtype), tuple(logits.shape), logits.detach().clone()))
    return dump


def _train_on_rank(rank: int, world_size: int, side: SideConfig, target: tuple[str, str] | None) -> Dump:
    """Inside a gloo rank: FSDP2 under the policy, every rank on the same token ids, recorded."""
    from fx_precision.fsdp import apply_fsdp2, layer_wrap_globs
    from fx_precision.ranks import cpu_mesh

    torch.set_num_threads(1)  # the same kernels, blocked alike, whatever the rank count: bitwise comparable
    cfg = side.policy
    model = shared_model(cfg.model, cfg.seed)
    policy = cfg.policy(model)
    plan = policy.plan(model, wrap=layer_wrap_globs(model))
    mesh = cpu_mesh(world_size, cfg.mesh)
    ids = _ids(model, cfg)
    fix = eager_casts(model, ids, policy=policy, plan=plan, **forward_kwargs(model)) if cfg.eager_fix else None
    apply_fsdp2(model, plan, mesh=mesh, policy=policy)
    if fix is not None:
        fix.apply(model)
    with torch.no_grad(), policy.forward_context("cpu"), DumpRecorder(model, inputs=side.inputs) as recorder:
        run_forward(model, ids, **forward_kwargs(model))
    recorder.dump.source = f"train rank {rank}/{world_size} ({policy.describe()})"
    if target is not None:  # every rank writes its directory of the staging dump; one rename puts it in place
        staging, final = target
        recorder.dump.save(staging)
        if launched():  # no parent process to rename it: rank 0 does, once every rank has written
            torch.distributed.barrier()
            if rank == 0:
                replace_dir(Path(staging), Path(final))
    return recorder.dump


def dump_on_ranks(side: SideConfig, out: str | os.PathLike[str], *, overwrite: bool = False) -> list[Dump]:
    """``fx-precision dump --world-size N``: each rank writes ``out/rank{r}`` (one rank: ``out`` itself).

    The ranks write a staging directory beside ``out``, renamed into place once all are done: an
    interrupted run leaves the old dump or nothing, and an overwrite replaces every rank's directory."""
    from fx_precision.dump import check_out_path
    from fx_precision.ranks import run_on_ranks

    check_out_path(out, overwrite=overwrite)
    final = Path(out)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT")  # the same on every torchrun rank
    token = f"{os.getppid()}-{run_id}" if launched() and run_id else f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # PID: the writer, alive
    staging = final.parent / f".{final.name}.writing-{token}"
    try:
        dumps = run_on_ranks(_train_on_rank, max(side.world_size, 1), side, (str(staging), str(final)))
        if not launched():
            replace_dir(staging, final)
    finally:
        if not launched() or launcher_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
    return dumps


def rollout_dump(rollout: str, train: SideConfig) -> Dump | str:
    """``bf16``: the stand-in rollout, in process; anything else: a dump directory."""
    if rollout != "bf16":
        if not os.path.isdir(rollout):
            raise PrecisionError(f"--rollout {rollout!r}: neither 'bf16' nor a dump directory")
        return rollout
    cfg = replace(train.policy, compute=None, rules="", arch_rules=False)
    model = shared_model(cfg.model, cfg.seed)
    with torch.no_grad():  # the weights, not the buffers: RoPE's inv_freq stays fp32, as engines keep it
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    ids = _ids(model, cfg)
    with torch.no_grad(), DumpRecorder(model, inputs=True, replay=True) as recorder:
        run_forward(model, ids, **forward_kwargs(model))
    recorder.dump.source = "rollout stand-in: bf16 weights, eager, no autocast"
    return recorder.dump


def describe(dump: Dump | Any) -> str:
    return dump.source if isinstance(dump, Dump) else str(dump)
