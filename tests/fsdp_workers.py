"""Functions that run inside gloo ranks (spawned by ``run_on_ranks``); importable by name."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fx_precision.fsdp import apply_fsdp2, fsdp_units, layer_wrap_globs
from fx_precision.logprobs import logits_of
from fx_precision.policy import resolve_policy
from fx_precision.ranks import cpu_mesh
from fx_precision.spec import parse_precision_rules
from fx_precision.tools.zoo import build_model, token_batch

BATCH, SEQ = 4, 16


def in_turn(rank: int, world_size: int, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any] | None:
    """Several workers of this module one after another in the same ranks: one spawn (an interpreter and
    its imports per rank) instead of one per run. Dynamo is reset between them; rank 0 returns the results."""
    results = []
    for name, args in calls:
        torch._dynamo.reset()
        results.append(globals()[name](rank, world_size, *args))
    return results if rank == 0 else None


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def wrapped_model(
    model_name: str, rules: str, compute: str | None, world_size: int, seed: int = 0, mesh: tuple[int, int] | None = None
) -> tuple[nn.Module, Any, Any]:
    model = build_model(model_name, seed=seed)
    policy = resolve_policy(model, gather="fp32", compute=compute, spec=parse_precision_rules(rules))
    plan = policy.plan(model, wrap=layer_wrap_globs(model))
    apply_fsdp2(model, plan, mesh=cpu_mesh(world_size, mesh), policy=policy)
    return model, policy, plan


def train_step(
    rank: int,
    world_size: int,
    model_name: str,
    rules: str,
    compute: str | None,
    ckpt_dir: str | None,
    mesh: tuple[int, int] | None = None,
) -> dict[str, Any] | None:
    """One fwd+bwd+SGD step on this rank's slice of a fixed batch; report dtypes, loss, grads, params.
    ``mesh=(R, S)``: HSDP on a 2-D mesh instead of FSDP on a 1-D one."""
    model, policy, plan = wrapped_model(model_name, rules, compute, world_size, mesh=mesh)
    seen: dict[str, dict[str, torch.dtype]] = {}

    def record(fqn: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            # the whole subtree: some weights are read without calling their module (Qwen3.5's conv1d)
            seen[fqn] = {name: p.dtype for name, p in module.named_parameters()}

        return hook

    for fqn, module in model.named_modules():
        module.register_forward_pre_hook(record(fqn))

    ids = token_batch(model, batch=BATCH, seq_len=SEQ, seed=1)
    per_rank = BATCH // world_size
    local = ids[rank * per_rank : (rank + 1) * per_rank]
    with policy.forward_context("cpu"):
        logits = logits_of(model(local))
    loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), local[:, 1:].flatten())
    loss.backward()

    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    sharded = {n: (p.dtype, p.grad.dtype if p.grad is not None else None, type(p).__name__) for n, p in model.named_parameters()}
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}

    restored: dict[str, torch.Tensor] | None = None
    if ckpt_dir is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(ckpt_dir, "step1"))
        fresh, _, _ = wrapped_model(model_name, rules, compute, world_size, seed=123)
        state = get_model_state_dict(fresh)
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, "step1"))
        set_model_state_dict(fresh, state)
        restored = {n: _full(p.detach()).clone() for n, p in fresh.named_parameters()}

    if rank != 0:
        return None
    return {
        "plan_gather": {alias: p.gather for p in plan.params.values() for alias in p.aliases},
        # the modules a parameter's unit shards (a group unit: every module sharing a tied weight)
        "unit_of": {alias: plan.unit(p.unit).group or (p.unit,) for p in plan.params.values() for alias in p.aliases},
        "seen": seen,
        "loss": float(loss_sum) / world_size,
        "sharded": sharded,
        "grads": grads,
        "params": params,
        "restored": restored,
        "units": [(fqn, mp) for fqn, mp in fsdp_units(model)],
        "cast_forward_inputs": policy.cast_forward_inputs,
    }


def default_vs_plain_wrap(rank: int, world_size: int, model_name: str) -> dict[str, Any] | None:
    """Units and MixedPrecisionPolicy of (a) the default resolved policy, (b) a plain per-layer wrap."""
    from fx_precision.tools.census_driver import plain_layer_wrap

    ours, policy, _ = wrapped_model(model_name, "", None, world_size)
    plain = build_model(model_name)
    plain_layer_wrap(plain, cpu_mesh(world_size))
    if rank != 0:
        return None
    return {
        "ours": fsdp_units(ours),
        "plain": fsdp_units(plain),
        "rules": len(policy.spec),
        "cast_forward_inputs": policy.cast_forward_inputs,
    }


def per_block_compile(rank: int, world_size: int, cast_forward_inputs: bool) -> dict[str, Any] | None:
    """Tiny Qwen3.5 under FSDP2 (embedding at bf16 by the arch rule), each decoder layer compiled
    with precision_backend (aot_eager) using the plan apply_fsdp2 applied; one fwd+bwd."""
    from fx_precision.backend import make_precision_backend
    from tests.aot_inner import aot_eager_reshape

    model = build_model("qwen3_5-tiny")
    policy = resolve_policy(model, gather="fp32", compute="bf16", cast_forward_inputs=cast_forward_inputs)
    plan = policy.plan(model, wrap=layer_wrap_globs(model))
    apply_fsdp2(model, plan, mesh=cpu_mesh(world_size), cast_forward_inputs=cast_forward_inputs)
    backend = make_precision_backend(plan=plan, inner=aot_eager_reshape)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    ids = token_batch(model, batch=2, seq_len=16, seed=rank)
    with policy.forward_context("cpu"):
        logits = logits_of(model(ids, use_cache=False))
    logits.float().pow(2).mean().backward()
    grads = {n: (p.grad.dtype if p.grad is not None else None) for n, p in model.named_parameters()}
    if rank != 0:
        return None
    return {
        "reports": [r.to_dict() for r in backend.reports],
        "grad_dtypes": grads,
        "logits_dtype": logits.dtype,
    }


def per_block_eager_fix(rank: int, world_size: int, arch_name: str, eager_fix: bool) -> dict[str, Any] | None:
    """A transformers architecture under FSDP2 (resolve_policy, bf16 autocast), each decoder layer
    compiled alone with precision_backend (aot_eager): fp32 stream nodes per block graph, with or
    without the derived eager hooks on what runs eagerly around the blocks; one fwd+bwd."""
    from torch._dynamo import lookup_backend

    from fx_precision.backend import make_precision_backend
    from fx_precision.eager_fix import eager_casts
    from fx_precision.tools.arch_zoo import arch
    from fx_precision.tools.sweep import fp32_stream_nodes

    spec = arch(arch_name)
    model = spec.build()
    policy = resolve_policy(model, gather="fp32", compute="bf16")
    plan = policy.plan(model, wrap=layer_wrap_globs(model))
    ids = torch.randint(0, model.config.vocab_size, (spec.batch, 8), generator=torch.Generator().manual_seed(rank))
    fix = eager_casts(model, input_ids=ids, policy=policy, plan=plan) if eager_fix else None
    apply_fsdp2(model, plan, mesh=cpu_mesh(world_size), policy=policy)
    if fix is not None:
        fix.apply(model)
    streams: list[int] = []
    inner = lookup_backend("aot_eager")

    def counting(gm: Any, example_inputs: Any) -> Any:
        streams.append(len(fp32_stream_nodes(gm)))
        return inner(gm, example_inputs)

    backend = make_precision_backend(plan=plan, inner=counting)
    for layer in model.get_submodule(layer_wrap_globs(model)[0].removesuffix(".*")).children():
        layer.compile(backend=backend)
    with policy.forward_context("cpu"):
        logits = logits_of(model(input_ids=ids, use_cache=False))
    logits.float().pow(2).mean().backward()
    if rank != 0:
        return None
    return {
        "block_fp32_stream": streams,
        "wide_inputs": [f.message for r in backend.reports for f in r.before if f.kind == "wide-input" and f.severity == "warn"],
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "hooks": len(fix.hooks) if fix is not None else 0,
    }


def _runs3(in_features: int) -> tuple[int, ...]:
    chunks = (in_features + 31) // 32
    return (3,) * (chunks // 3) + ((chunks % 3,) if chunks % 3 else ())


def contract_training(rank: int, world_size: int, arch_name: str, contract: dict[str, Any] | None, steps: int) -> dict[str, Any] | None:
    """An arch-zoo model under FSDP2 (per-layer units, gather and compute bf16), compiled whole with
    precision_backend (aot_eager) with the engine contract's rewrites or without; ``steps`` SGD steps on
    one fixed batch split over the ranks. Reports losses, dtypes, the first step's gradients, the rewrites."""
    from dataclasses import replace

    from fx_precision.backend import make_precision_backend
    from fx_precision.contract import EngineContract
    from fx_precision.contract.batch_rows import EngineRows, engine_rows
    from fx_precision.contract.linear_order import LinearOrder, LinearOrders, engine_linear_shapes
    from fx_precision.policy import PrecisionPolicy
    from fx_precision.tools.arch_zoo import arch

    torch.set_num_threads(1)
    model = arch(arch_name).build(seed=0).train()
    kept = EngineContract.from_dict(contract) if contract is not None else None
    ids = token_batch(model, batch=BATCH, seq_len=SEQ, seed=1)
    per_rank = BATCH // world_size
    local = ids[rank * per_rank : (rank + 1) * per_rank]
    rows = torch.full(local.shape, local.numel(), dtype=torch.int32)  # as if the engine had computed this batch in one call
    if kept is not None:  # every GEMM of the model in a blocked order (three-chunk blocks) at the batch's rows
        shapes = engine_linear_shapes(model, input_ids=local[:, :4], use_cache=False)
        blocked = LinearOrders.uniform(shapes, [local.numel()], lambda k: LinearOrder(blocks=_runs3(k), parts=(len(_runs3(k)),)))
        kept = replace(kept, linears=blocked)
    policy = PrecisionPolicy(gather=torch.bfloat16, compute=torch.bfloat16, cast_forward_inputs=False, contract=kept)
    plan = policy.plan(model, wrap=layer_wrap_globs(model))
    apply_fsdp2(model, plan, mesh=cpu_mesh(world_size), policy=policy)
    backend = make_precision_backend(policy=policy, plan=plan, inner="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def plan() -> Any:  # the batch's row plan, entered for each step's forward
        return engine_rows(EngineRows(rows, rows, kept.linears)) if kept is not None else contextlib.nullcontext()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grads = [], None
    for _ in range(steps):
        with policy.forward_context("cpu"), plan():
            logits = logits_of(compiled(input_ids=local, use_cache=False))
        loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
        if first_grads is None:
            first_grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    if rank != 0:
        return None
    return {
        "losses": losses,
        "master_dtypes": {n: p.dtype for n, p in model.named_parameters()},
        "grad_dtypes": {n: p.grad.dtype for n, p in model.named_parameters()},
        "grads": first_grads,
        "rewrites": {name: sum(r.rewrites.get(name, 0) for r in backend.reports) for name in backend.reports[0].rewrites},
    }


def sleep_and_note_exit(rank: int, world_size: int, directory: str) -> None:
    """A rank that notes it started, blocks, and notes in its finally block that it ended (tests/test_lifetime.py)."""
    import time
    from pathlib import Path

    # Written whole, then renamed: a reader that sees the name sees the pid (a plain write is seen empty for a moment).
    Path(directory, f".started-{rank}").write_text(str(os.getpid()))
    os.replace(Path(directory, f".started-{rank}"), Path(directory, f"started-{rank}"))
    try:
        time.sleep(300)
    finally:
        Path(directory, f"exited-{rank}").write_text("")


def fail_on_rank_one(rank: int, world_size: int, directory: str) -> None:
    """Rank 1 fails once rank 0 is blocked; torch's process context then terminates rank 0 (tests/test_lifetime.py)."""
    import time
    from pathlib import Path

    if rank == 0:
        sleep_and_note_exit(rank, world_size, directory)
        return
    deadline = time.monotonic() + 60
    while not Path(directory, "started-0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("rank one's own failure")


def abort_in_native_code_on_rank_one(rank: int, world_size: int, directory: str) -> None:
    """Rank 1 dies of SIGABRT (as a heap check in native code ends a process); rank 0 waits (tests/test_lifetime.py)."""
    import os

    if rank == 0:
        sleep_and_note_exit(rank, world_size, directory)
        return
    os.abort()
