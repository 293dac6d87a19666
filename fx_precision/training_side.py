"""The training side, as one ordered list of steps: what ``compare --rollout``, the benchmarks and the on-policy loop run.

    build_training_side(RunConfig, mesh)             each step takes the side so far and gives it back
    1 build     the model as fp32 masters: a checkpoint's weights (they hold its bf16 values exactly, as after a weight
                sync), or what ``cfg.model()`` builds (compare's built-in zoo sides); under a contract that follows MoE
                experts, transformers' batched_mm experts (each MoE block one graph)
    2 policy    ``cfg.policy(model)`` (gather / compute / rules), or, following an engine contract, the contract's:
                gather bf16, compute bf16, the contract's graph rewrites in the backend (``contract_policy``); a compiled
                engine's norm sums bound to the model's norm modules (contract/inductor_norms.py)
    3 plan      the policy lowered onto the model (per-layer units under FSDP2)
    4 eager fix with ``cfg.eager_fix``: the backend's casts derived on ``cfg.example_ids`` (fxp.eager_casts), before
                the shard (they are read from the unsharded model)
    5 shard     apply_fsdp2 on ``mesh`` (a gloo rank), or none: gathers emulated at use in process
    6 hooks     the eager fix's casts registered as module hooks (after FSDP2's own); under a compiled engine's contract
                whose model adds its residual itself (norm inductor-stream) the input embedding's output widened to fp32,
                as the engine's stream starts
    7 compile   torch.compile with precision_backend (Inductor, or aot_eager); under a contract always (the contract is
                a graph rewrite: "eager" under it is the pass with aot_eager)

    with side.forward_context(rows): side.run(tokens)    one forward: the policy's autocast, the engine's row plan
                                                     (rows: EngineRows, under a contract), the gathers emulated at use
                                                     in process (eager: gathered_eagerly; compiled: the backend's casts)
    side.logits(tokens, rows)                        the same, its [B, T, V] logits

Each rank of an FSDP2 run builds its own side from the same RunConfig. Steps 1 to 5 hold the whole fp32 model on the
rank until the shard frees it: the ranks take those steps one after another (``WHOLE_MODEL_UNTIL``), so the ranks' peak
memory is one whole model and the others' shards, not one whole model per rank (at the Qwen3-30B-A3B shape's two
layers, 7 GiB each).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import NormForm
from fx_precision.errors import PrecisionError, first_line, precision_error_in
from fx_precision.policy import PrecisionPolicy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fx_precision.backend import PrecisionBackend
    from fx_precision.eager_fix import EagerFix
    from fx_precision.plan import PrecisionPlan


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


ModelSource = Callable[[], nn.Module]  # builds the fp32 masters; picklable: each rank builds its own
PolicySource = Callable[[nn.Module], PrecisionPolicy]  # the policy for the model built; picklable (policy_flags.PolicyFlags)
TokenSource = Callable[[nn.Module], torch.Tensor]  # token ids [B, T] for the model built; picklable


@dataclass(frozen=True)
class RunConfig:
    """One training side, the one config type from the CLI's flags to TrainingSide: the model (a checkpoint directory,
    or a ModelSource), its policy, the contract it follows (None: none), how it runs (compiled or eager, in process or
    FSDP2 on ``world_size`` gloo ranks over ``mesh``), and what it runs on and records (the built-in sides' token
    batch, module inputs). compare, dump, the benchmarks and the on-policy loop each build one; every rank receives
    it pickled."""

    model: str | ModelSource
    policy: PolicySource = field(default_factory=AsUsersRunIt)
    contract: EngineContract | None = None
    compiled: bool = False
    inner: str = "inductor"  # the backend's inner compiler when compiled
    train: bool | None = False  # the model in train mode (dropout stays off: the configs here have none); None: as built
    eager_fix: bool = False  # the backend's casts as module hooks: the precision fix without torch.compile
    example_ids: torch.Tensor | TokenSource | None = field(default=None, compare=False)  # what the eager fix is derived on
    world_size: int = 0  # 0: in process, gathers emulated at use; N: FSDP2 on N gloo ranks
    mesh: tuple[int, int] | None = None  # HSDP: (replicas, shards); None: a 1-D mesh over every rank
    tokens: TokenSource | None = None  # the token batch a built-in side runs (an engine dump's side runs the dump's)
    replay_routes: bool = False  # against an MoE engine dump: route each token to the experts the engine routed it to
    record_inputs: bool = True  # record every module call's inputs (the comparator's origins need them); against an
    # engine dump: record module calls at all (False: the log-probs only)

    def compiles(self) -> bool:
        return self.compiled or self.contract is not None

    def inner_compiler(self) -> str:
        return self.inner if self.compiled else "aot_eager"

    def check(self) -> None:
        """One line naming the flag and the fix for a side that cannot be built as asked."""
        if self.eager_fix and self.compiles():
            why = "the engine contract compiles the side" if self.contract is not None else "--compiled compiles the side"
            raise PrecisionError(
                f"--eager-fix is the precision fix without torch.compile, and {why}: precision_backend applies the same casts "
                "in the graph; drop --eager-fix"
            )
        if self.eager_fix and self.example_ids is None:
            raise PrecisionError("RunConfig(eager_fix=True) derives the casts on example token ids: pass example_ids")


def plain_forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for a plain forward: ``use_cache=False`` for transformers models."""
    config = getattr(model, "config", None)
    return {"use_cache": False} if config is not None and hasattr(config, "use_cache") else {}


def run_forward(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)``; a failure of the model's own code is one PrecisionError line."""
    try:
        return model(*args, **kwargs)
    except PrecisionError:
        raise
    except Exception as exc:  # the user's model: its failure, said in one line; the backend's own error as it is
        inner = precision_error_in(exc)
        if inner is not None:
            raise inner from None
        from fx_precision.census import module_class_name

        name = module_class_name(getattr(model, "_orig_mod", model))  # the user's class, compiled or under FSDP2
        raise PrecisionError(f"the forward of {name} raised {type(exc).__name__}: {first_line(exc)}") from exc


@dataclass
class TrainingSide:
    """What the steps built (module docstring): each field is set by the step that makes it."""

    cfg: RunConfig
    mesh: DeviceMesh | None = None
    model: nn.Module = field(init=False)  # build
    name: str = ""  # build: the user's class name (before FSDP2 makes it FSDP<name>)
    policy: PrecisionPolicy = field(init=False)  # policy
    plan: PrecisionPlan = field(init=False)  # plan
    sharded: bool = False  # shard
    forward: Callable[..., Any] = field(init=False)  # compile: the model, or torch.compile of it
    backend: PrecisionBackend | None = None  # compile, where it compiles
    fix: EagerFix | None = None  # eager fix, with cfg.eager_fix

    @contextlib.contextmanager
    def forward_context(self, rows: Any = None) -> Iterator[None]:
        """What a forward of this side runs under (module docstring)."""
        from fx_precision.contract.batch_rows import engine_rows
        from fx_precision.fsdp import gathered_eagerly

        if rows is None and self.policy.contract is not None:
            raise PrecisionError("a forward under the engine contract needs the engine's row plan (EngineRows) of its batch")
        with contextlib.ExitStack() as stack:
            if not self.sharded and not self.cfg.compiles():  # compiled, the backend casts at use in the graph
                stack.enter_context(gathered_eagerly(self.model, self.plan))
            stack.enter_context(self.policy.forward_context("cpu"))
            if rows is not None:
                stack.enter_context(engine_rows(rows))
            yield

    def run(self, tokens: torch.Tensor) -> Any:
        """The model's output on ``tokens`` [B, T], inside ``forward_context``."""
        return run_forward(self.forward, tokens, **plain_forward_kwargs(self.model))

    def logits(self, tokens: torch.Tensor, rows: Any = None) -> torch.Tensor:
        """[B, T, V] logits of ``tokens`` [B, T] (module docstring)."""
        from fx_precision.logprobs import logits_of

        with self.forward_context(rows):
            return logits_of(self.run(tokens))

    def describe(self) -> str:
        how = f"FSDP2 on {self.mesh.size()} gloo rank(s)" if self.sharded and self.mesh is not None else "in process"
        compiled = f", compiled with precision_backend ({self.cfg.inner_compiler()})" if self.cfg.compiles() else ", eager"
        return f"train, {how}{compiled} ({self.describe_policy()})"

    def describe_policy(self) -> str:
        fix = f", eager fix: {len(self.fix.hooks)} hook(s)" if self.fix is not None else ""
        return f"{self.policy.describe()}{fix}"

    def rewrites(self) -> dict[str, int]:
        reports = getattr(self.backend, "reports", None) or []
        return {name: n for r in reports for name, n in r.rewrites.items() if n}


def _build(side: TrainingSide) -> TrainingSide:
    from fx_precision.checkpoints import load_checkpoint

    source = side.cfg.model
    side.model = load_checkpoint(source, dtype=torch.float32) if isinstance(source, str) else source()
    if side.cfg.train is not None:
        side.model.train(side.cfg.train)
    side.name = type(side.model).__name__  # before FSDP2 makes it FSDP<name>
    if side.cfg.contract is not None and side.cfg.contract.moe is not None:
        _experts_in_one_graph(side.model)
    return side


def _experts_in_one_graph(model: nn.Module) -> None:
    """Under a contract that follows the engine's experts: transformers' ``batched_mm`` experts, whose shapes do not
    depend on the routes, so each MoE block is traced whole (``grouped_mm``'s data-dependent offsets break the graph
    inside the block when it trains) and the contract's rewrite takes the block as one (its arithmetic is the engine's
    whichever implementation it replaces)."""
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        try:
            setter("batched_mm")
        except (ValueError, KeyError):  # a model that cannot switch: its graphs are refused where a block is split
            pass


def _policy(side: TrainingSide) -> TrainingSide:
    policy = side.cfg.policy(side.model)
    contract = side.cfg.contract
    if contract is not None and contract.norm_reductions is not None:  # the compiled engine's norm sums, bound to the modules
        from fx_precision.contract.inductor_norms import bind_norm_modules, register_norm_orders

        bound = bind_norm_modules(contract.norm_reductions, side.model)
        register_norm_orders(side.model, bound)
        contract = replace(contract, norm_reductions=bound)
    side.policy = contract_policy(policy, contract) if contract is not None else policy
    return side


def _plan(side: TrainingSide) -> TrainingSide:
    from fx_precision.fsdp import layer_wrap_globs

    side.plan = side.policy.plan(side.model, wrap=layer_wrap_globs(side.model) if side.mesh is not None else ())
    return side


def _derive_fix(side: TrainingSide) -> TrainingSide:
    if side.cfg.eager_fix:
        from fx_precision.eager_fix import eager_casts

        ids = side.cfg.example_ids
        ids = ids(side.model) if callable(ids) else ids
        side.fix = eager_casts(side.model, ids, policy=side.policy, plan=side.plan, **plain_forward_kwargs(side.model))
        if side.mesh is not None and side.fix.gathers:  # weights an uncovered op reads (MoE experts): FSDP2 gathers them narrow
            side.policy = side.fix.gathered_policy(side.policy)
            side = _plan(side)
    return side


def _register_fix(side: TrainingSide) -> TrainingSide:
    if side.fix is not None:
        side.fix.apply(side.model)
    contract = side.policy.contract
    if contract is not None and contract.norm == NormForm.INDUCTOR_STREAM:
        _stream_from_the_embedding_in_fp32(side.model)
    return side


def _stream_from_the_embedding_in_fp32(model: nn.Module) -> None:
    """The compiled engine keeps its residual stream in fp32 from the embedding on (Inductor never rounds a fused
    intermediate): the input embedding's output widened to fp32 (exact), so what a model's code does to it outside a
    graph (under FSDP2 the root's forward runs eagerly: Granite's ``embeds * embedding_multiplier``) multiplies
    unrounded, as the engine's kernel does, and the first layer takes the fp32 stream (where the engine's norm kernel
    stores it narrow, ``fxp_engine.inductor_stream`` rounds it there)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if isinstance(embedding, nn.Module):
        embedding.register_forward_hook(lambda _m, _args, out: out.float() if isinstance(out, torch.Tensor) else out)


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

        side.backend = make_precision_backend(policy=side.policy, plan=side.plan, inner=side.cfg.inner_compiler(), model=side.model)
        side.forward = torch.compile(side.model, backend=side.backend, dynamic=False)
    return side


STEPS: tuple[tuple[str, Callable[[TrainingSide], TrainingSide]], ...] = (
    ("build", _build),
    ("policy", _policy),
    ("plan", _plan),
    ("eager fix", _derive_fix),
    ("shard", _shard),
    ("hooks", _register_fix),
    ("compile", _compile),
)


WHOLE_MODEL_UNTIL = "shard"  # from the first step to this one the rank holds the whole model: the ranks take them in turn


def build_training_side(cfg: RunConfig, mesh: DeviceMesh | None = None) -> TrainingSide:
    """Run the steps (module docstring) in order; ``mesh``: FSDP2 over it (inside one of ``cfg.world_size`` gloo ranks),
    None: in process."""
    cfg.check()
    side = TrainingSide(cfg, mesh)
    whole = [name for name, _ in STEPS].index(WHOLE_MODEL_UNTIL) + 1
    with one_rank_at_a_time(mesh):
        for _name, step in STEPS[:whole]:
            side = step(side)
    for _name, step in STEPS[whole:]:
        side = step(side)
    return side


@contextlib.contextmanager
def one_rank_at_a_time(mesh: DeviceMesh | None) -> Iterator[None]:
    """The body runs on one rank of the process group after another (rank r after rank r - 1 left it): rank r waits at
    r barriers before it, and at world - r after, so the i-th barrier opens when rank i is done. In process, or on one
    rank: at once. A rank that fails inside stops its peers' next barrier (gloo names the peer that closed)."""
    import torch.distributed as dist  # loaded with FSDP2's ranks only

    if mesh is None or not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(rank):
        dist.barrier()
    yield
    gc.collect()  # the whole model's tensors the shard replaced: gone before the next rank loads its own
    for _ in range(world - rank):
        dist.barrier()


@contextlib.contextmanager
def compile_limits(graphs: int) -> Iterator[None]:
    """Dynamo may compile ``graphs`` graphs (static shapes: one per length) and fails rather than run a frame eagerly,
    without the pass, past its limit."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=max(64, graphs), fail_on_recompile_limit_hit=True):
        yield
