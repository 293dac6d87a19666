"""The CLI's policy flags as one picklable policy factory: what every verb that builds a policy reads.

    PolicyFlags(master, gather, compute, rules, arch_rules, cast_forward_inputs)(model) -> PrecisionPolicy
    ├── arch_rules on   resolve_policy: the architecture's rules (fx_precision/archs) under the user's
    └── arch_rules off  the flags as given, no architecture rule

A census (CensusConfig), a training side (training_side.RunConfig: compare, dump, the benchmarks) and the sweep build
their policy from it; FSDP2 ranks receive it pickled and build the same policy on their own model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fx_precision.policy import PrecisionPolicy, resolve_policy
from fx_precision.spec import PrecisionSpec, parse_precision_rules


@dataclass(frozen=True)
class PolicyFlags:
    """``--master``, ``--gather``, ``--compute`` (canonical dtype names; None: none), ``--rules``, ``--no-arch-rules``,
    ``--cast-forward-inputs`` (True / False, or None for the policy's own resolution)."""

    master: str | None = "fp32"
    gather: str = "fp32"
    compute: str | None = "bf16"
    rules: str = ""
    arch_rules: bool = True
    cast_forward_inputs: bool | None = None

    def build_dtype(self) -> Any:
        """What a checkpoint config is built at: the master dtype (None, "as loaded": what the file stores)."""
        from fx_precision.dtypes import parse_dtype

        return parse_dtype(self.master) if self.master else None

    def __call__(self, model: Any) -> PrecisionPolicy:
        spec = parse_precision_rules(self.rules)
        if self.arch_rules:
            return resolve_policy(
                model, master=self.master, gather=self.gather, compute=self.compute, spec=spec, cast_forward_inputs=self.cast_forward_inputs
            )
        from fx_precision.dtypes import optional_dtype, parse_dtype

        return PrecisionPolicy(
            master=optional_dtype(self.master, what="--master"),
            gather=parse_dtype(self.gather, what="--gather"),
            compute=optional_dtype(self.compute, what="--compute"),
            spec=spec or PrecisionSpec(),
            cast_forward_inputs=self.cast_forward_inputs,
        )
