"""FXP301 engine-unfollowed: under an engine contract, what the graph still computes with a kernel the contract does
not follow. A contract silently broken there would only show after a rollout, so the backend refuses the graph.

    eager softmax attention        a softmax over q @ k^T a few ops before (Gemma2's soft-capping, Bloom's ALiBi)
    a linear as another product    a matrix product with a weight operand the linear rewrite did not take
    mixture-of-experts routing     a top-k left: the probe read no MoE kernel (its reason), or a router the MoE rewrite
                                   did not take
    a causal convolution           conv1d (a linear-attention layer: GatedDeltaNet)
    an unfollowed rotary           a negation multiplied after a stack / cat, or x1*c - x2*s written out (interleaved
                                   pairs, MLA), where the contract's rotary is the kernel's
    unrecorded logits scaling      x / c or x * c on the logits where the rollout recorded no logits processing
                                   (the logits rewrite's mark: an older rollout)

``unfollowed(gm, contract)`` returns the findings; ``passes/rewrites/engine`` runs it last and raises them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from fx_precision.contract import EngineContract
from fx_precision.contract.vocabulary import OpClass, RotaryForm
from fx_precision.passes.graph.kinds import FindingKind, Severity
from fx_precision.passes.graph.linear_forms import transposed_weight, weight_like
from fx_precision.passes.graph.nodes import ENGINE_MADE, is_call, module_path, source_line
from fx_precision.passes.rules.findings import CODES, Finding

UNRECORDED_SCALE = "fxp_logits_unrecorded"  # set by passes/rewrites/engine/logits.py on a scaling it could not follow

MUL = {operator.mul, torch.mul}

_MATMUL = {torch.matmul, torch.bmm, torch.baddbmm, torch.einsum, operator.matmul}
_MATMUL_METHODS = ("matmul", "bmm", "baddbmm")
_SOFTMAX = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax}
_SHAPING = {torch.stack, torch.cat, torch.flatten}
_SHAPING_METHODS = ("flatten", "view", "reshape", "contiguous")


def _near(node: fx.Node, wanted: Callable[[fx.Node], bool], hops: int, upward: bool) -> bool:
    frontier = [node]
    for _ in range(hops):
        frontier = [n for f in frontier for n in (f.all_input_nodes if upward else f.users)]
        if any(wanted(n) for n in frontier):
            return True
    return False


def _eager_attention(node: fx.Node) -> bool:
    """A softmax over scores a matmul of two activations made a few ops before (q @ k^T, not a router's linear)."""
    is_softmax = is_call(node, _SOFTMAX, "softmax")
    return is_softmax and _near(
        node, lambda n: is_call(n, _MATMUL) or (n.op == "call_method" and n.target in _MATMUL_METHODS), hops=6, upward=True
    )


def _rotation_left(node: fx.Node) -> bool:
    """A rotary the rotary rewrite did not take: a negation multiplied after a stack / cat (rotate-half in
    another layout), or a cat of ``x1*c - x2*s`` with its partner (the rotation written out, as MLA does)."""
    if is_call(node, {operator.neg, torch.neg}, "neg"):
        stack, shaped = list(node.users), False
        for _ in range(4):
            nxt: list[fx.Node] = []
            for user in stack:
                if is_call(user, MUL, "mul") and shaped:
                    return True
                if is_call(user, _SHAPING) or (user.op == "call_method" and user.target in _SHAPING_METHODS):
                    shaped = True
                    nxt.extend(user.users)
            stack = nxt
        return False
    if is_call(node, {torch.cat, torch.stack}) and node.args and isinstance(node.args[0], (list, tuple)):
        parts = [p for p in node.args[0] if isinstance(p, fx.Node)]
        return any(
            is_call(p, {operator.sub, torch.sub}, "sub")
            and all(is_call(a, MUL, "mul") for a in p.all_input_nodes)
            and len(p.all_input_nodes) == 2
            for p in parts
        )
    return False


def _weight_gemm(node: fx.Node) -> bool:
    """A matrix product with a weight operand that the linear rewrite left (another form than it takes)."""
    gemm = is_call(node, {*_MATMUL, torch.mm, torch.addmm}) or (node.op == "call_method" and node.target in (*_MATMUL_METHODS, "mm"))
    return gemm and any(weight_like(a) or transposed_weight(a) is not None for a in node.args if isinstance(a, fx.Node))


FOLLOWED = (
    "the contract follows dense decoders: scaled_dot_product_attention (attn_implementation='sdpa'), half-split (neox) rotary on "
    "bf16 tensors, F.linear / x @ w.T / addmm linears, dense MLPs, MoE blocks of stacked experts behind a softmax top-k router; "
    "compare without --contract to see the gap (an MoE model: --replay-routes)"
)


def _finding(node: fx.Node, message: str) -> Finding:
    kind = FindingKind.ENGINE_UNFOLLOWED
    return Finding(CODES[kind], Severity.ERROR, kind, module_path(node), None, node.name, source_line(node), (), message,
                   suggestion=FOLLOWED)  # fmt: skip


def unfollowed(gm: fx.GraphModule, contract: EngineContract) -> list[Finding]:
    """What ``gm`` computes that ``contract`` does not follow (module docstring), one finding each."""
    found = []
    kernel_rotary = contract.rotary is not None and contract.rotary.form == RotaryForm.KERNEL
    for node in gm.graph.nodes:
        if _eager_attention(node):
            found.append(_finding(node, "attention computed as matmul + softmax: the engine's attention kernel is not followed"))
        elif _weight_gemm(node):
            found.append(_finding(node, f"a linear written as {node.target}: the engine's GEMM order is followed for F.linear, x @ w.T "
                                        "and addmm only"))  # fmt: skip
        elif is_call(node, {torch.topk}, "topk"):
            why = contract.why_unmatched().get(OpClass.MOE, "the rollout read no MoE kernel" if contract.moe is None else "a router "
                                               "whose experts the MoE rewrite did not take")  # fmt: skip
            found.append(_finding(node, f"mixture-of-experts routing (topk): the engine's experts are not followed here ({why})"))
        elif is_call(node, {torch.conv1d, torch.nn.functional.conv1d}):
            found.append(_finding(node, "a causal convolution (a linear-attention layer): the engine's kernel is not followed"))
        elif kernel_rotary and ENGINE_MADE not in node.meta and _rotation_left(node):
            found.append(_finding(node, "a rotary the contract does not follow (interleaved pairs, or rotated in fp32)"))
        elif UNRECORDED_SCALE in node.meta:
            found.append(_finding(node, f"logits scaled by {node.meta[UNRECORDED_SCALE]!r}, and the rollout recorded no logits processing "
                                        "(contract.logits): roll out again with fx-precision rollout of this version"))  # fmt: skip
    return found
