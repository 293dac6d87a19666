"""The toy task of the on-policy loop: a reward computed from token ids alone.

    TargetTokens(modulus=4)    reward of a sample = the share of its sampled ids with ``id % modulus == 0``

A random tiny model samples near-uniformly, so the reward starts near ``1 / modulus``; the policy gradient moves
probability mass onto the target ids (the output projection's rows of a quarter of the vocabulary), which a tiny
model does within a few steps on two cores: the reward visibly rises. Nothing about the task is engine- or
contract-specific; it is there so a run shows learning and certification side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fx_precision.errors import PrecisionError


@dataclass(frozen=True)
class TargetTokens:
    modulus: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.modulus, int) or isinstance(self.modulus, bool) or self.modulus < 2:
            raise PrecisionError(f"TargetTokens(modulus={self.modulus!r}): an integer of at least 2")

    def reward(self, sampled: Sequence[int]) -> float:
        """The share of ``sampled`` ids that are targets (0 for an empty sample)."""
        if not sampled:
            return 0.0
        return sum(1 for t in sampled if int(t) % self.modulus == 0) / len(sampled)

    def describe(self) -> str:
        return f"reward = share of sampled ids with id % {self.modulus} == 0"
