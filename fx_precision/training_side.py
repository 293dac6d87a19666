"""The training side, as one ordered list of steps: what ``compare --rollout``, the benchmarks and the on-policy loop run.

    build_training_side(RunConfig, mesh)             each step takes the side so far and gives it back
    1 build     the checkpoint's weights as fp32 masters (they hold its bf16 values exactly, as after a weight sync)
    2 policy    ``cfg.policy(model)`` (gather / compute / rules), or, following an engine contract, the contract's:
                gather bf16, compute bf16, the contract's graph rewrites in the backend (``contract_policy``)
    3 plan      the policy lowered onto the model (per-layer units under FSDP2)
    4 shard     apply_fsdp2 on ``mesh`` (a gloo rank), or none: gathers emulated at use in process
    5 compile   torch.compile with precision_backend (Inductor, or aot_eager); under a contract always (the contract is
                a graph rewrite: "eager" under it is the pass with aot_eager)

    side.logits(tokens, rows)                        one forward: the policy's autocast, the engine's row plan (rows:
                                                     EngineRows, under a contract), the gathers emulated at use in process
                                                     (eager: gathered_eagerly; compiled: the backend's casts)

Each rank of an FSDP2 run builds its own side from the same RunConfig.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from fx_precision.contract import EngineContract
from fx_precision.errors import PrecisionError
from fx_precision.policy import PrecisionPolicy


def contract_policy(policy: PrecisionPolicy, contract: EngineContract) -> PrecisionPolicy:
    """``policy`` following ``contract``: the engine runs bf16 weights and bf16 compute, and the backend rewrites the
    graph to compute what it computes."""
    return replace(policy, gather=torch.bfloat16, compute=torch.bfloat16, cast_forward_inputs=False, contract=contract)


@dataclass(frozen=True)
class AsUsersRunIt:
    """The policy RL trainers run today: fp32 masters gathered at ``gather``, the forward under ``compute`` autocast."""

    gather: torch.dtype = torch.float32
    compute: torch.dtype | None = torch.bfloat16

    def __call__(self, model: nn.Module) -> PrecisionPolicy:
        return PrecisionPolicy(gather=self.gather, compute=self.compute)


@dataclass(frozen=True)
class RunConfig:
    """One training side: the checkpoint, its policy, the contract it follows (None: none), how it runs."""

    checkpoint: str
    policy: Callable[[nn.Module], PrecisionPolicy] = field(default_factory=AsUsersRunIt)  # picklable (ranks get it)
    contract: EngineContract | None = None
    compiled: bool = False
    inner: str = "inductor"  # the backend's inner compiler when compiled
    train: bool = False  # the model in train mode (dropout stays off: the configs here have none)

    def compiles(self) -> bool:
        return self.compiled or self.contract is not None

    def inner_compiler(self) -> str:
        return self.inner if self.compiled else "aot_eager"


@dataclass
class TrainingSide:
    """What the steps built (module docstring)."""

    cfg: RunConfig
    mesh: Any = None
    model: Any = None
    name: str = ""
    policy: Any = None
    plan: Any = None
    sharded: bool = False
    forward: Any = None
    backend: Any = None

    def logits(self, tokens: torch.Tensor, rows: Any = None) -> torch.Tensor:
        """[B, T, V] logits of ``tokens`` [B, T] (module docstring)."""
        from fx_precision.contract.batch_rows import engine_rows
        from fx_precision.fsdp import gathered_eagerly
        from fx_precision.logprobs import logits_of

        with contextlib.ExitStack() as stack:
            if not self.sharded and not self.cfg.compiles():  # compiled, the backend casts at use in the graph
                stack.enter_context(gathered_eagerly(self.model, self.plan))
            stack.enter_context(self.policy.forward_context("cpu"))
            if rows is not None:
                stack.enter_context(engine_rows(rows))
            elif self.policy.contract is not None:
                raise PrecisionError("a forward under the engine contract needs the engine's row plan (EngineRows) of its batch")
            return logits_of(self.forward(input_ids=tokens, use_cache=False))

    def describe(self) -> str:
        how = f"FSDP2 on {self.mesh.size()} gloo rank(s)" if self.sharded else "in process"
        compiled = f", compiled with precision_backend ({self.cfg.inner_compiler()})" if self.cfg.compiles() else ", eager"
        return f"train, {how}{compiled} ({self.policy.describe()})"

    def rewrites(self) -> dict[str, int]:
        reports = getattr(self.backend, "reports", None) or []
        return {name: n for r in reports for name, n in r.rewrites.items() if n}


def _build(side: TrainingSide) -> TrainingSide:
    from fx_precision.checkpoints import load_checkpoint

    side.model = load_checkpoint(side.cfg.checkpoint, dtype=torch.float32)
    side.model.train(side.cfg.train)
    side.name = type(side.model).__name__  # before FSDP2 makes it FSDP<name>
    return side


def _policy(side: TrainingSide) -> TrainingSide:
    policy = side.cfg.policy(side.model)
    side.policy = contract_policy(policy, side.cfg.contract) if side.cfg.contract is not None else policy
    return side


def _plan(side: TrainingSide) -> TrainingSide:
    from fx_precision.fsdp import layer_wrap_globs

    side.plan = side.policy.plan(side.model, wrap=layer_wrap_globs(side.model) if side.mesh is not None else ())
    return side


def _shard(side: TrainingSide) -> TrainingSide:
    if side.mesh is not None:
        from fx_precision.fsdp import apply_fsdp2

        apply_fsdp2(side.model, side.plan, mesh=side.mesh, policy=side.policy)
        side.sharded = True
    return side


def _compile(side: TrainingSide) -> TrainingSide:
    side.forward = side.model
    if side.cfg.compiles():
        from fx_precision.backend import make_precision_backend

        side.backend = make_precision_backend(policy=side.policy, plan=side.plan, inner=side.cfg.inner_compiler())
        side.forward = torch.compile(side.model, backend=side.backend, dynamic=False)
    return side


STEPS: tuple[tuple[str, Callable[[TrainingSide], TrainingSide]], ...] = (
    ("build", _build),
    ("policy", _policy),
    ("plan", _plan),
    ("shard", _shard),
    ("compile", _compile),
)


def build_training_side(cfg: RunConfig, mesh: Any = None) -> TrainingSide:
    """Run the steps (module docstring) in order; ``mesh``: FSDP2 over it (inside a gloo rank), None: in process."""
    side = TrainingSide(cfg, mesh)
    for _name, step in STEPS:
        side = step(side)
    return side


@contextlib.contextmanager
def compile_limits(graphs: int) -> Iterator[None]:
    """Dynamo may compile ``graphs`` graphs (static shapes: one per length) and fails rather than run a frame eagerly,
    without the pass, past its limit."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=max(64, graphs), fail_on_recompile_limit_hit=True):
        yield
