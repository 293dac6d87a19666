"""A model's whole state, to assert that a refused call changed nothing: parameter objects, their data
and dtypes, buffers, hooks and classes (``apply_fsdp2`` and ``EagerFix`` promise nothing half-applied)."""

from __future__ import annotations

import torch


def model_snapshot(model: torch.nn.Module) -> tuple:
    """Everything apply_fsdp2 could change: parameter objects, their data and dtypes, buffers, hooks, classes."""
    params = [(n, id(p), type(p), p.dtype, p.detach().clone()) for n, p in model.named_parameters()]
    buffers = [(n, b.dtype, b.clone()) for n, b in model.named_buffers()]
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks), type(m)) for m in model.modules()]
    return params, buffers, hooks


def same_model_state(a: tuple, b: tuple) -> bool:
    (pa, ba, ha), (pb, bb, hb) = a, b
    return (
        [x[:4] for x in pa] == [x[:4] for x in pb]
        and all(torch.equal(x[4], y[4]) for x, y in zip(pa, pb, strict=True))
        and [x[:2] for x in ba] == [x[:2] for x in bb]
        and all(torch.equal(x[2], y[2]) for x, y in zip(ba, bb, strict=True))
        and ha == hb
    )
