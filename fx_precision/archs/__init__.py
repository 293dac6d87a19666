"""Per-architecture precision rules: the registry, and the architectures that register with it.

    archs/registry.py          register_arch, arch_rules, input_embedding_fqns
    archs/gated_delta_net.py   Qwen3.5 / Qwen3.6 / Qwen3-Next: the input embedding at compute dtype
    archs/moe_experts.py       stacked MoE experts (grouped_mm: not autocast-covered) at compute dtype

Importing this package imports every architecture module, which registers itself with the
registry (the registry imports none of them: no cycle).
"""

from fx_precision.archs import gated_delta_net, moe_experts
from fx_precision.archs.registry import arch_rules, input_embedding_fqns, register_arch

__all__ = ["arch_rules", "gated_delta_net", "input_embedding_fqns", "moe_experts", "register_arch"]
