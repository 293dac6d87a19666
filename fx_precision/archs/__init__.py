"""Per-architecture precision rules, resolved by ``resolve_policy``.

A provider looks at a model's ``transformers`` config and the run's policy and returns the
rules that architecture needs (often none). Providers are self-activating: they return rules
only when the policy's dtypes make them matter.

    register_arch(provider)          provider(config, policy) -> PrecisionSpec
    arch_rules(config, policy)       the concatenation of every provider's rules, in registration order
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fx_precision.spec import PrecisionSpec

if TYPE_CHECKING:
    from fx_precision.policy import PrecisionPolicy

ArchProvider = Callable[[Any, "PrecisionPolicy"], PrecisionSpec]
_PROVIDERS: list[ArchProvider] = []


def register_arch(provider: ArchProvider) -> ArchProvider:
    """Register a rule provider (usable as a decorator)."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)
    return provider


def arch_rules(config: Any, policy: PrecisionPolicy) -> PrecisionSpec:
    spec = PrecisionSpec()
    for provider in _PROVIDERS:
        spec = spec + provider(config, policy)
    return spec


from fx_precision.archs import gated_delta_net  # noqa: E402,F401  (registers itself)
