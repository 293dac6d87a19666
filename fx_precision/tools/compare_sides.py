"""Built-in sides for ``fx-precision dump`` and ``compare``: a training policy and a bf16 rollout stand-in.

    train side     the training side (fx_precision/training_side.py, the steps compare --rollout, the
                   benchmarks and the on-policy loop run) on a built-in model: its fp32 masters, rounded
                   to bf16 first (as after loading a bf16 checkpoint), under a policy: gather (emulated
                   at use on one device, or FSDP2 on N gloo ranks), compute (autocast), rules, the eager
                   fix; eager, or compiled with precision_backend (the logits only)
    rollout bf16   the same weights (parameters) cast to bf16, eager, no autocast: a stand-in for an inference
                   engine (sglang / vLLM run the bf16 checkpoint), not the engine itself
    rollout DIR    a dump written anywhere (an engine's own process, another machine)

``built_in_side(RunConfig(name, policy=PolicyFlags(...), ...), batch=, seq_len=)`` makes the training side's RunConfig
a built-in side (the CLI's flags give it); ``train_dump``, ``write_dump`` and ``built_in_sides`` run it. Both sides see
the same token ids. In-process sides keep replays (op-level drill-down); a side on
gloo ranks or compiled records what it can (module calls on ranks; only the logits when compiled).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fx_precision.dump import Dump, DumpRecorder, Record
from fx_precision.errors import PrecisionError
from fx_precision.out_dirs import replace_dir
from fx_precision.ranks import launched, launcher_rank
from fx_precision.tools.zoo import build_model, forward_kwargs, token_batch
from fx_precision.training_side import RunConfig, TrainingSide, build_training_side, run_forward


def shared_model(name: str, seed: int = 0) -> nn.Module:
    """The model both sides start from: fp32 masters rounded to bf16-representable values."""
    model = build_model(name, seed=seed, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


@dataclass(frozen=True)
class ZooModel:
    """The training side's ModelSource for a built-in model name: ``shared_model(name, seed)``."""

    name: str
    seed: int = 0

    def __call__(self) -> nn.Module:
        return shared_model(self.name, self.seed)


@dataclass(frozen=True)
class ZooTokens:
    """A built-in side's TokenSource: ``token_batch(model, batch, seq_len, seed)``, the same ids on both sides."""

    batch: int = 2
    seq_len: int = 16
    seed: int = 1
    device: str = "cpu"

    def __call__(self, model: nn.Module) -> torch.Tensor:
        return token_batch(model, batch=self.batch, seq_len=self.seq_len, seed=self.seed, device=self.device)


def built_in_side(cfg: RunConfig, *, batch: int = 2, seq_len: int = 16, seed: int = 0) -> RunConfig:
    """``cfg`` as a built-in side: its model (a built-in name, factory or config) built from ``seed`` with its fp32
    masters rounded to bf16 (ZooModel), on a token batch of ``batch`` x ``seq_len``, the eager fix (where asked)
    derived on the very token ids the side runs."""
    if not isinstance(cfg.model, str):
        raise PrecisionError("built_in_side: RunConfig(model=) names the built-in model (a name, factory or config)")
    tokens = ZooTokens(batch, seq_len, seed + 1)
    return replace(cfg, model=ZooModel(cfg.model, seed), tokens=tokens, example_ids=tokens if cfg.eager_fix else None)


def _tokens(cfg: RunConfig, model: nn.Module) -> torch.Tensor:
    if cfg.tokens is None:
        raise PrecisionError("a built-in side runs its own token batch: RunConfig(tokens=...) (compare_sides.built_in_side)")
    return cfg.tokens(model)


def train_dump(cfg: RunConfig) -> Dump:
    """Record the training side (see the module docstring)."""
    if cfg.contract is not None:
        raise PrecisionError("a built-in side follows no engine contract: the contract is an engine dump's (compare --rollout DUMP)")
    if cfg.world_size > 0:
        from fx_precision.ranks import run_on_ranks

        dumps = run_on_ranks(_train_on_rank, cfg.world_size, cfg, None)
        return dumps[0]
    return _record(build_training_side(cfg))


def _record(train: TrainingSide, source: str = "train") -> Dump:
    """One forward of ``train`` on the side's token ids, recorded: module calls (with replays in process), or, compiled,
    the logits only."""
    ids = _tokens(train.cfg, train.model)
    if train.cfg.compiles():
        with torch.no_grad():
            logits = train.logits(ids)
        return _root_only(train.name, ids, logits, train.policy.compute, f"{source} (compiled: logits only)")
    recording = DumpRecorder(train.model, inputs=train.cfg.record_inputs, replay=not train.sharded)
    with torch.no_grad(), train.forward_context(), recording as recorder:
        train.run(ids)
    recorder.dump.source = f"{source} ({train.describe_policy()})"
    return recorder.dump


def _root_only(name: str, ids: torch.Tensor, logits: torch.Tensor, compute: torch.dtype | None, source: str) -> Dump:
    from fx_precision.dtypes import dtype_name
    from fx_precision.dump import CallInfo

    dump = Dump(name, autocast=dtype_name(compute) if compute else None, source=source)
    dump.calls.append(CallInfo("", 0, 1, 2))
    dump.records.append(Record("", 0, "in", "args[0]", dtype_name(ids.dtype), tuple(ids.shape), ids.clone()))
    dump.records.append(Record("", 0, "out", "out", dtype_name(logits.dtype), tuple(logits.shape), logits.detach().clone()))
    return dump


def _train_on_rank(rank: int, world_size: int, cfg: RunConfig, target: tuple[str, str] | None) -> Dump:
    """Inside a gloo rank: FSDP2 under the policy, every rank on the same token ids, recorded."""
    from fx_precision.ranks import cpu_mesh

    torch.set_num_threads(1)  # the same kernels, blocked alike, whatever the rank count: bitwise comparable
    train = build_training_side(cfg, mesh=cpu_mesh(world_size, cfg.mesh))
    dump = _record(train, source=f"train rank {rank}/{world_size}")
    if target is not None:  # every rank writes its directory of the staging dump; one rename puts it in place
        staging, final = target
        dump.save(staging)
        if launched():  # no parent process to rename it: rank 0 does, once every rank has written
            torch.distributed.barrier()
            if rank == 0:
                replace_dir(Path(staging), Path(final))
    return dump


def dump_on_ranks(cfg: RunConfig, out: str | os.PathLike[str], *, overwrite: bool = False) -> list[Dump]:
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
        dumps = run_on_ranks(_train_on_rank, max(cfg.world_size, 1), cfg, (str(staging), str(final)))
        if not launched():
            replace_dir(staging, final)
    finally:
        if not launched() or launcher_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
    return dumps


def write_dump(cfg: RunConfig, out: str | os.PathLike[str], *, overwrite: bool = False) -> list[Dump]:
    """``fx-precision dump``: the train side recorded to ``out``, in process, or one directory per rank on FSDP2 ranks
    (under torchrun always: every rank writes its own)."""
    if launched():
        cfg = replace(cfg, world_size=int(os.environ["WORLD_SIZE"]))
    if cfg.world_size > 0:
        return dump_on_ranks(cfg, out, overwrite=overwrite)
    dump = train_dump(cfg)
    dump.save(out, overwrite=overwrite)
    return [dump]


@dataclass
class CompareSides:
    """What ``compare`` reads: side a and side b (dumps, or dump directories), the head lines saying where each came
    from, and what a contract the training side follows does not follow."""

    a: Dump | str
    b: Dump | str
    head: str
    notes: list[str] = field(default_factory=list)
    routes: dict[str, Any] | None = None  # against an MoE engine dump: the training side's routes against the engine's


def built_in_sides(cfg: RunConfig, rollout: str) -> CompareSides:
    """The train side against ``rollout``: the bf16 stand-in, or a dump directory."""
    a, b = train_dump(cfg), rollout_dump(rollout, cfg)
    name = cfg.model.name if isinstance(cfg.model, ZooModel) else cfg.model
    return CompareSides(a, b, f"{name}; fp32 masters rounded to bf16 first\na: {describe(a)}\nb: {describe(b)}")


def rollout_dump(rollout: str, train: RunConfig) -> Dump | str:
    """``bf16``: the stand-in rollout, in process; anything else: a dump directory."""
    if rollout != "bf16":
        if not os.path.isdir(rollout):
            raise PrecisionError(f"--rollout {rollout!r}: neither 'bf16' nor a dump directory")
        return rollout
    if not isinstance(train.model, ZooModel):
        raise PrecisionError("--rollout bf16 is the stand-in of a built-in side: give --model a built-in name, factory or config")
    model = train.model()  # the same fp32 masters rounded to bf16, no policy: bf16 weights, no autocast
    model.eval()  # as the training side runs its model
    with torch.no_grad():  # the weights, not the buffers: RoPE's inv_freq stays fp32, as engines keep it
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    ids = _tokens(train, model)
    with torch.no_grad(), DumpRecorder(model, inputs=True, replay=True) as recorder:
        run_forward(model, ids, **forward_kwargs(model))
    recorder.dump.source = "rollout stand-in: bf16 weights, eager, no autocast"
    return recorder.dump


def describe(dump: Dump | Any) -> str:
    return dump.source if isinstance(dump, Dump) else str(dump)
