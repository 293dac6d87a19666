"""Mixture-of-experts experts stored as stacked weights: gathered at the compute dtype.

    Qwen3MoeSparseMoeBlock (and Qwen2-MoE, Qwen3.5-MoE, Mixtral, DeepSeek-V3, ...)
    ├── gate                   nn.Linear router: autocast covers it (its fp32 softmax is the program's)
    └── experts                gate_up_proj (E, 2I, H), down_proj (E, H, I): one tensor per projection
                               for all E experts, read by grouped_mm after ``input.to(weight.dtype)``.
                               grouped_mm is not autocast-covered, so the experts compute at the
                               dtype they are gathered at: fp32 under an fp32 gather.
                               -> gather the experts at the compute dtype

The experts are found by what they hold, not by a list of model types: a module with two or more
3-D floating-point parameters of one leading size (the expert count) holds stacked expert weights
that one fused op reads per expert. (A ``Conv1d`` has one 3-D weight; an ``nn.ModuleList`` of
per-expert ``nn.Linear`` runs under autocast and needs no rule, and holds no 3-D parameter.)
Without the model, a config that names an expert count (``num_experts``, ``num_local_experts``,
``n_routed_experts``) selects ``*.experts``.

Self-activating: no rule unless a compute dtype is set and differs from the gather dtype. No rule
either where the compute dtype's grouped GEMM cannot run the experts: ``grouped_mm`` needs every
stride a multiple of 16 bytes (torch 2.13 refuses bf16 experts with an intermediate size of 12:
24-byte rows), and transformers calls it eagerly whatever the sizes. Those experts stay at the
gather dtype eagerly; under ``torch.compile`` the backend still casts their weight reads (lint FXP001),
and transformers' traced fallback op runs any size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fx_precision.archs.registry import DtypeAxes, register_arch
from fx_precision.spec import ModuleSel, PrecisionSpec, Rule

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


GROUPED_GEMM_ALIGNMENT = 16  # bytes: grouped_mm's stride requirement (CPU and CUDA)


def holds_stacked_experts(module: nn.Module) -> bool:
    """Two or more 3-D floating-point parameters of its own, sharing their leading (expert) size."""
    stacked = _stacked(module)
    return len(stacked) >= 2 and len({p.shape[0] for p in stacked}) == 1


def _stacked(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()]


def grouped_gemm_runs(sizes: list[int], dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` at ``dtype`` takes rows of these sizes (each a multiple of 16 bytes)."""
    return all(size * dtype.itemsize % GROUPED_GEMM_ALIGNMENT == 0 for size in sizes)


def stacked_expert_fqns(model: nn.Module) -> list[str]:
    """The modules that hold stacked expert weights, by what they hold."""
    return [fqn for fqn, module in model.named_modules() if holds_stacked_experts(module)]


def _configs(config: Any) -> list[Any]:
    """A config and its text config (a multimodal checkpoint's decoder), where present."""
    return [cfg for cfg in (config, getattr(config, "text_config", None)) if cfg is not None]


def names_expert_count(config: Any) -> bool:
    """A config (or its text config) with an expert count above one."""
    return any(isinstance(getattr(cfg, f, None), int) and getattr(cfg, f) > 1 for cfg in _configs(config) for f in EXPERT_COUNT_FIELDS)


@register_arch
def experts_at_compute_dtype(config: Any, policy: DtypeAxes, model: nn.Module | None = None) -> PrecisionSpec:
    """Every module holding stacked expert weights (by what it holds when the model is known; ``*.experts`` from a config)."""
    if policy.compute is None or policy.compute == policy.gather:
        return PrecisionSpec()
    compute = policy.compute
    if model is not None:
        fqns = [
            fqn
            for fqn in stacked_expert_fqns(model)
            if grouped_gemm_runs([size for p in _stacked(model.get_submodule(fqn)) for size in p.shape[1:]], compute)
        ]
    else:
        sizes = [getattr(cfg, f, None) for cfg in _configs(config) for f in ("hidden_size", "moe_intermediate_size")]
        known = [size for size in sizes if isinstance(size, int)]
        fqns = ["*.experts"] if names_expert_count(config) and grouped_gemm_runs(known, compute) else []
    return PrecisionSpec(tuple(Rule(ModuleSel(fqn=fqn), gather=policy.compute) for fqn in fqns))
