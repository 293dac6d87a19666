"""The registry of per-architecture precision rules, resolved by ``resolve_policy``.

A provider looks at a model's ``transformers`` config and the run's dtype axes and returns the
rules that architecture needs (often none). Providers are self-activating: they return rules
only when the policy's dtypes make them matter.

    DtypeAxes                            what a provider reads of the policy: its gather and compute dtypes
    register_arch(provider)              provider(config, axes, model | None) -> PrecisionSpec
    arch_rules(config, policy, model)    the concatenation of every provider's rules, in registration order
    input_embedding_fqns(model)          the input embeddings by role (get_input_embeddings), not by name
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from fx_precision.spec import PrecisionSpec


class DtypeAxes(Protocol):
    """What a provider reads of a policy (``PrecisionPolicy`` is one): the gather and compute dtypes."""

    @property
    def gather(self) -> torch.dtype: ...

    @property
    def compute(self) -> torch.dtype | None: ...


ArchProvider = Callable[[Any, DtypeAxes, "nn.Module | None"], PrecisionSpec]
_PROVIDERS: list[ArchProvider] = []


def register_arch(provider: ArchProvider) -> ArchProvider:
    """Register a rule provider (usable as a decorator)."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)
    return provider


def arch_rules(config: Any, policy: DtypeAxes, model: nn.Module | None = None) -> PrecisionSpec:
    """Every provider's rules; ``model`` (when known) lets a rule select modules by role, not by name."""
    spec = PrecisionSpec()
    for provider in _PROVIDERS:
        spec = spec + provider(config, policy, model)
    return spec


def input_embedding_fqns(model: nn.Module) -> list[str]:
    """FQNs of the input embeddings, by role: ``get_input_embeddings()`` where the model has one
    (transformers: ``model.embed_tokens``, GPT-2's ``transformer.wte``), else every ``nn.Embedding``
    (hand-written models: ``tok_embeddings``, learned positions)."""
    getter = getattr(model, "get_input_embeddings", None)
    found = None
    if callable(getter):
        try:
            found = getter()
        except (NotImplementedError, AttributeError):
            found = None
    targets = [found] if isinstance(found, nn.Module) else [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return [fqn for fqn, module in model.named_modules() if any(module is t for t in targets)]
