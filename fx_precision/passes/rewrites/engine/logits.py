"""Op class ``logprobs``, its graph part: the logits scaled as the engine's logits processor scales them.

fxp_engine.linear(..., logits=True) -> [views, casts] -> x / c | x * c      the model's logits scaling (Granite)
->  fxp_engine.logits_scale(x, scale)                                      x * scale in x's dtype, the engine's
                                                                           ``logits *= scale`` (contract.logits)
A soft cap (x / cap -> tanh -> * cap: Gemma 2) is the engine's own sequence of ops and stays the model's. The model's
constant must be the engine's (1 / c == scale, or c == scale); a graph that scales its logits where the engine does not,
or not where it does, is refused in one line; against a contract that recorded nothing (an older rollout) the scaling
is left marked (``UNRECORDED_SCALE``) for the coverage check, which refuses it with whatever else is unfollowed.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.logits import LogitsForm
from fx_precision.contract.vocabulary import OpClass
from fx_precision.errors import PrecisionError
from fx_precision.passes.context import PassContext
from fx_precision.passes.graph.nodes import module_path
from fx_precision.passes.rewrites.engine.common import PASS_THROUGH, EngineRewrite, RewriteFn, constant_factor, record, replace_node
from fx_precision.passes.rules.engine_coverage import UNRECORDED_SCALE

LOGPROBS = OpClass.LOGPROBS
CLOSE = 1e-12  # the model's 1 / c against the engine's scale: the same Python float up to the division's rounding


def _is_tanh(node: fx.Node) -> bool:
    """tanh, as the model calls it or as the eager-math rewrite keeps it (``fxp_engine.eager_math(x, "tanh", ...)``)."""
    if node.op == "call_method":
        return node.target == "tanh"
    kept = node.op == "call_function" and node.target is torch.ops.fxp_engine.eager_math.default
    return (node.op == "call_function" and node.target is torch.tanh) or (kept and len(node.args) > 1 and node.args[1] == "tanh")


def _soft_cap_end(divided: fx.Node) -> fx.Node | None:
    """The ``* cap`` ending a soft cap (x / cap -> tanh -> * cap) that starts at ``divided``, else None."""
    tanhs = [u for u in divided.users if _is_tanh(u)]
    ends = [u for u in tanhs[0].users if constant_factor(u, tanhs[0]) is not None] if len(tanhs) == 1 else []
    return ends[0] if len(ends) == 1 else None


def _scalings(logits: fx.Node) -> list[tuple[fx.Node, fx.Node, float]]:
    """(node, the logits it scales, factor) of each constant scaling on the logits' way out, through views and casts;
    a soft cap is the engine's own ops and is walked past."""
    found, stack, seen = [], [logits], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if (user.op == "call_method" and user.target in PASS_THROUGH) or (
                user.op == "call_function" and user.target is operator.getitem
            ):
                stack.append(user)
            elif (factor := constant_factor(user, node)) is not None:
                end = _soft_cap_end(user)
                if end is not None:
                    stack.append(end)
                else:
                    found.append((user, node, factor))
                    stack.append(user)
    return found


def _refusal(where: str, scalings: list[tuple[fx.Node, fx.Node, float]], form: LogitsForm | None) -> str | None:
    """Why the model's scalings at ``where`` are not the engine's ``form`` (None: they are, or neither scales)."""
    engine = form.scale if form is not None else None
    factors = ", ".join(repr(f) for _, _, f in scalings)
    if not scalings:
        if engine in (None, 1.0):
            return None
        return f"the engine scales its logits by {engine!r} after the GEMM, the model's at {where} are not scaled"
    if form is None:  # left to the coverage check (passes/rules/engine_coverage.py), which names it among the rest
        return None
    if len(scalings) > 1 or abs(scalings[0][2] - form.scale) > CLOSE * abs(form.scale):
        return f"the model scales its logits at {where} by {factors}, the engine by {form.scale!r}"
    return None


def engine_logits(contract: EngineContract) -> RewriteFn:
    """The op class's graph rewrite for ``contract`` (module docstring)."""

    def rewrite(gm: fx.GraphModule, ctx: PassContext) -> list[EngineRewrite]:
        graph = gm.graph
        heads = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.fxp_engine.linear.default and n.args[3]]
        form = contract.logits
        done = []
        for head in heads:
            scalings = _scalings(head)
            why = _refusal(module_path(head) or "<root>", scalings, form)
            if why is not None:
                raise PrecisionError(f"engine contract: {why}: the checkpoint's config differs from the engine's (logits_scaling)")
            if form is None:
                for node, _, factor in scalings:
                    node.meta[UNRECORDED_SCALE] = factor
                continue
            if not scalings:
                continue
            node, x, _ = scalings[0]
            scale = form.scale

            def build(x: fx.Node = x, scale: float = scale) -> fx.Node:
                return graph.call_function(torch.ops.fxp_engine.logits_scale.default, (x, scale))

            made = replace_node(graph, node, build, LOGPROBS)
            done.append(record(LOGPROBS, made, node, f"the logits x {scale!r} in their dtype, as the engine's logits processor"))
        if done:
            gm.recompile()
        return done

    return rewrite
