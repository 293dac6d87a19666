"""The contract's ops that read or write state beyond their tensors, declared as such to the compiler.

    state                                   written by             read by
    the forward's row plan (EngineRows:     engine_rows(...)       fxp_engine::linear (each row's engine call),
    engine calls, KV tiles, GDN pieces)     (batch_rows.py)        ::attention (KV tiles, where none are passed),
                                                                   ::gdn (prefilled pieces, decoded tokens)
    the forward's residual sums             ::residual_add         ::unrounded_residual (the next graph's norm)
    (ContractForward.residual_sums)
    the norm orders bound to modules        register_norm_orders   ::inductor_sum_squares, ::inductor_stream
                                                                   (found by its weight)
    the route sink (RouteTap)               ::record_routes        the tap, after the forward (the ids each
                                                                   ::moe_route chose; the router itself is pure)

Each such op is registered with an ordered effect (``declare_forward_state``): AOTAutograd threads an effect token
through every one of them in a compiled graph (the token an input and an output of each call, ``with_effects``),
so no graph pass reorders them against each other, drops one whose output looks unused (record_routes has
none), or has the partitioner recompute one in backward. The state lives while ``engine_rows`` is open (outside it they refuse in one line);
activation checkpointing reruns the forward inside it and reads the same plan and the same sums, so its recompute
gives the same bits (tests/test_forward_state.py runs each op under torch.compile with checkpointing), and a
recompute in backward does not record routes twice. The ops of pure tensor arithmetic (rotary, stored, eager
math, the fused experts, the gated norm, the logits scale) are left free to move.
"""

from __future__ import annotations

from torch._library.custom_ops import CustomOpDef
from torch._library.effects import EffectType


def declare_forward_state(op: CustomOpDef) -> CustomOpDef:
    """``op`` registered as reading or writing state beyond its tensors (module docstring): an ordered effect."""
    op.register_effect(EffectType.ORDERED)
    return op
