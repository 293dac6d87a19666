"""What the rollout's probe read of the engine's GatedDeltaNet layers (the contract's ``gdn`` op class): typed, no ops
(contract/gdn.py holds the kernels and the ops that compute it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHUNK = 64  # the chunk kernel's chunk
PORTABLE = "portable"  # vLLM's _C_AVX2 build: ATen's generic lanes, glibc's libm, no FMA
PORTABLE_FMA = "portable-fma"  # vLLM's _C_AVX512 build: the same generic lanes, the decode recurrence's multiply-adds fused
AVX512 = "avx512"  # vLLM's _C build on an AVX-512 BF16 CPU: packed VDPBF16PS conv, exp_u20, VRCP14PS, libtorch's brgemm
KERNELS = (PORTABLE, PORTABLE_FMA, AVX512)
HEAD_DIMS = (64, 128)  # what the engine's chunk kernel takes (it refuses 32)
STATE_DTYPES = ("bf16", "fp32")


def gdn_layer_count(config: PretrainedConfig) -> int:
    """The GatedDeltaNet ("linear_attention") layers a transformers config names (its text config's, for a
    vision-language one): 0 for a model without them."""
    text = getattr(config, "text_config", None) or config
    types = getattr(text, "layer_types", None)
    return sum(1 for t in types if t == "linear_attention") if isinstance(types, (list, tuple)) else 0


@dataclass(frozen=True)
class GdnForm:
    """How the engine computes its GatedDeltaNet layers: the kernel build (``PORTABLE``, ``PORTABLE_FMA``, ``AVX512``), the SSM
    state cache's dtype (bf16: rounded after every chunk and decoded token; fp32), and the l2-norm's eps."""

    kernels: str = PORTABLE
    state: str = "bf16"
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise PrecisionError(f"GdnForm.kernels={self.kernels!r}: the contract follows {', '.join(map(repr, KERNELS))} (vLLM's "
                                 "_C_AVX2 build, its _C_AVX512 build, and its _C build on an AVX-512 BF16 CPU)")  # fmt: skip
        if self.kernels == AVX512 and self.state != "fp32":
            raise PrecisionError(f"GdnForm.state={self.state!r}: the AVX-512 build's kernels are followed with an fp32 state cache")
        if self.state not in STATE_DTYPES:
            raise PrecisionError(f"GdnForm.state={self.state!r}: one of {', '.join(STATE_DTYPES)}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0.0 < float(self.eps) < 1.0:
            raise PrecisionError(f"GdnForm.eps={self.eps!r}: a small positive number")

    def describe(self) -> str:
        return f"{self.kernels} kernels, {self.state} state, chunks of {CHUNK}, eps {self.eps:g}"

    def to_dict(self) -> dict[str, Any]:
        return {"kernels": self.kernels, "state": self.state, "eps": float(self.eps)}

    @classmethod
    def from_dict(cls, data: object, where: str = "contract.gdn") -> GdnForm:
        if not isinstance(data, dict) or set(data) != {"kernels", "state", "eps"}:
            raise PrecisionError(f"{where}: an object of kernels, state and eps, got {data!r}"[:300])
        try:
            return cls(**data)
        except PrecisionError as exc:
            raise PrecisionError(str(exc).replace("GdnForm.", f"{where}.")) from None
