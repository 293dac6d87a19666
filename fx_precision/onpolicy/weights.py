"""The trainer's current weights as the engine runs them: the bf16 rounding of the fp32 masters, under checkpoint names.

    full_bf16_weights(model, names)   every rank calls it (under FSDP2 each DTensor is gathered whole: a collective
                                      in ``names`` order); the bf16 rounding (nearest even) of each master, which is
                                      what FSDP2's bf16 gather computes for the training forward too
    checkpoint_bf16_weights(path, names)  the same of a checkpoint's stored tensors (the masters before any update are
                                      its values: what step 0 of the loop sends without a gather)

Names are the checkpoint's (its safetensors keys): a tied output projection stored once is sent once; a model that holds
them in another layout (transformers 5's stacked MoE experts) is taken back to the checkpoint's by transformers' own
reverse conversion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fx_precision.errors import PrecisionError


def full_bf16_weights(model: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``names`` -> the whole bf16 tensor of each (module docstring)."""
    from torch.distributed.tensor import DTensor

    state = model.state_dict(keep_vars=True)
    if any(n not in state for n in names):  # stored in another layout (per-expert MoE weights the model holds stacked)
        return _in_checkpoint_layout(model, state, names)
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        value = state[name]
        key = id(value)
        if key not in gathered:
            with torch.no_grad():
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                gathered[key] = whole.detach().to(torch.bfloat16).contiguous()
        out[name] = gathered[key]
    return out


def _in_checkpoint_layout(model: nn.Module, state: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The model's whole bf16 state (every rank gathers every tensor, in key order) in the layout the checkpoint stores
    it: transformers' own reverse of the conversion it loaded the checkpoint with (``revert_weight_conversion``: e.g.
    an MoE's stacked ``experts.gate_up_proj`` back to each expert's ``gate_proj`` and ``up_proj``; slices, no
    arithmetic)."""
    from torch.distributed.tensor import DTensor

    revert: Any = None
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:  # an older transformers: the model holds the checkpoint's layout, or the names are missing below
        pass
    whole: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in sorted(state):
            value = state[name]
            if value.is_floating_point():
                full = value.full_tensor() if isinstance(value, DTensor) else value
                whole[name] = full.detach().to(torch.bfloat16)
    converted = revert(model, whole) if revert is not None else whole
    missing = [n for n in names if n not in converted]
    if missing:
        raise PrecisionError(f"weight sync: the trainer's model has no {missing[:3]} (checkpoint names it does not hold)")
    return {n: converted[n].contiguous() for n in names}


def checkpoint_bf16_weights(path: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``names`` -> the bf16 rounding (nearest even) of each stored tensor of the checkpoint at ``path``."""
    from safetensors import safe_open

    from fx_precision.checkpoints import stored_tensors

    files = {t.name: t.file for t in stored_tensors(path)}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in files:
            raise PrecisionError(f"weight sync: {path} stores no {name}")
        with safe_open(str(files[name]), framework="pt") as handle:
            out[name] = handle.get_tensor(name).to(torch.bfloat16).contiguous()
    return out
