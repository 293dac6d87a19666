"""The engine contract as graph rewrites: the training graph computes what the rollout engine computes.

One ordered list, the way Inductor's ``post_grad_passes`` lists its passes: each op class of the contract
is a (probe, op, rewrite) triple. The probe is the engine adapter's (``fx_precision.engines``: it reads the
op class off its engine), the ops are ``contract/ops.py``'s custom ops, the rewrite is here, one module per
op class, found by what the ops do, never by module names (every architecture with the pattern is covered)::

    OP_CLASSES     op class      probe (adapter)         ops (torch.ops.fxp_engine)           rewrite
    0              gdn           the GatedDeltaNet kernels gdn, gated_rms_norm (gdn.py)     gdn.engine_gdn (first: its
                                                                                                 region holds norms, exps)
    1              moe           the router, the experts moe_route, fused_moe                 moe.engine_moe (first: the
                                                                                                 block's output is bf16)
    2              norm          the fused norm          residual_add, unrounded_residual     norm.fuse_add_norm
    3              rotary        the rotary module       rotary (truncating store)            rotary.engine_rotary
    4              attention     the attention op        attention                            attention.engine_attention
    5              linears       each linear call        linear                               linears.engine_linears
    6              eager-math    (always)                eager_math, eager_layer_norm         eager_math.engine_eager_math
    7              logprobs      the logits processor,   logits_scale (contract/logits.py)    logits.engine_logits (the
                                 the sampler                                                  scale; the log_softmax is
                                                                                              the training side's)
    then           coverage      FXP301 findings (passes/rules/engine_coverage.py): what is left unfollowed

Each rewrite takes the contract and refuses a graph with its pattern where the probe matched nothing
(``EngineContract.refused``: the probe's reason, never a default). ``engine_rewrites(contract)`` is pipeline
step 5 (after the precision fix made the stream narrow). The custom ops keep Inductor from fusing the
contract's fp32 math in another order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import GraphRewrite, PassContext
from fx_precision.passes.rewrites.engine.attention import engine_attention
from fx_precision.passes.rewrites.engine.common import EngineRewrite, RewriteFn
from fx_precision.passes.rewrites.engine.eager_math import engine_eager_math
from fx_precision.passes.rewrites.engine.gdn import engine_gdn
from fx_precision.passes.rewrites.engine.linears import engine_linears
from fx_precision.passes.rewrites.engine.logits import engine_logits
from fx_precision.passes.rewrites.engine.moe import engine_moe
from fx_precision.passes.rewrites.engine.norm import fuse_add_norm
from fx_precision.passes.rewrites.engine.rotary import engine_rotary
from fx_precision.passes.rules.engine_coverage import unfollowed


@dataclass(frozen=True)
class OpClassPass:
    """One op class: its ops (``torch.ops.fxp_engine``) and its rewrite (None: not a graph op)."""

    op_class: OpClass
    ops: tuple[str, ...]
    rewrite: Callable[[EngineContract], RewriteFn] | None
    name: str  # the rewrite's name in reports


OP_CLASSES: tuple[OpClassPass, ...] = (
    OpClassPass(OpClass.GDN, ("gdn", "gated_rms_norm"), engine_gdn, "engine-gdn"),
    OpClassPass(OpClass.MOE, ("moe_route", "fused_moe"), engine_moe, "engine-moe"),
    OpClassPass(OpClass.NORM, ("residual_add", "unrounded_residual"), fuse_add_norm, "fused-add-norm"),
    OpClassPass(OpClass.ROTARY, ("rotary",), engine_rotary, "engine-rotary"),
    OpClassPass(OpClass.ATTENTION, ("attention",), engine_attention, "engine-attention"),
    OpClassPass(OpClass.LINEARS, ("linear",), engine_linears, "engine-linears"),
    OpClassPass(OpClass.EAGER_MATH, ("eager_math", "eager_layer_norm"), engine_eager_math, "engine-eager-math"),
    OpClassPass(OpClass.LOGPROBS, ("logits_scale",), engine_logits, "engine-logits"),
)


def engine_coverage(contract: EngineContract) -> RewriteFn:
    """Refuse a graph that still computes, with a kernel the contract does not follow, what the engine runs (FXP301)."""

    def check(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        left = unfollowed(gm, contract)
        if left:
            shown = "; ".join(f"{f.code} {f.message} at {f.module or '<root>'} ({f.source_line or f.node})" for f in left[:3])
            more = f" (and {len(left) - 3} more)" if len(left) > 3 else ""
            kept = f"engine contract ({contract.describe()}) cannot be kept on this graph"
            raise PrecisionError(f"{kept}: {shown}{more}. {left[0].suggestion}")
        return []

    return check


def engine_rewrites(contract: EngineContract) -> list[GraphRewrite]:
    """The contract's rewrites in the order of ``OP_CLASSES``, then the coverage check."""
    import fx_precision.contract.gdn  # (registers torch.ops.fxp_engine.gdn / gated_rms_norm)
    import fx_precision.contract.ops  # noqa: F401  (registers torch.ops.fxp_engine)

    steps = [GraphRewrite(p.name, p.rewrite(contract)) for p in OP_CLASSES if p.rewrite is not None]
    return [*steps, GraphRewrite("engine-coverage", engine_coverage(contract))]


__all__ = ["OP_CLASSES", "EngineRewrite", "OpClassPass", "engine_coverage", "engine_rewrites"]
