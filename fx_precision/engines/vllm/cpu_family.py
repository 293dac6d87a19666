"""The engine as each x86 CPU family runs it: what this machine is, and how an engine here runs as another family.

vLLM's CPU build picks its kernels by what the CPU has, in three places, and each can be told less than the
hardware has (a test device: one machine runs every family it can)::

    family        oneDNN's GEMM (ONEDNN_MAX_CPU_ISA)      vLLM's kernel build   SGL small-weight GEMM
    amx           brgemm on AMX tiles (no cap)             _C (AVX-512 + BF16)   yes
    avx512-bf16   brgemm with VDPBF16PS (AVX512_CORE_BF16) _C                    no
    avx512        gemm:jit:bf16, VDPBF16PS emulated        _C_AVX512             no
                  (AVX512_CORE)
    avx2          refuses bf16 (AVX2): vLLM falls back     _C_AVX2               no
                  to torch.nn.functional.linear (ATen's bf16 GEMM runs its AVX2 build on every x86 CPU)

torch's own eager kernels (the engine's norms' sums, its activations) run at the machine's ATen capability on both
sides; ``ATEN_CPU_CAPABILITY=avx2`` is not set for the avx2 family: on an AVX-512 CPU, torch 2.13's Inductor then
packs for AVX-512 against ATen's AVX2 kernels and fails (``pack_vnni2 is only supported when avx512 is supported``,
heap corruption on FSDP2 ranks). The contract records the engine's capability and the training side checks its own.

``native_family()`` reads ``/proc/cpuinfo`` (never assumed); ``family_settings(family)`` is the environment and the
answers of ``torch.cpu``'s checks that make the engine run as ``family``, refused where this CPU lacks what the
family needs (an AVX2 machine cannot run AVX-512 kernels). The machine's own family sets no cap: the engine runs as
its users launch it there. The rollout records both in its dump.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fx_precision.errors import PrecisionError
from fx_precision.text_enum import TextEnum


class CpuFamily(TextEnum):
    AMX = "amx"
    AVX512_BF16 = "avx512-bf16"
    AVX512 = "avx512"
    AVX2 = "avx2"


@dataclass(frozen=True)
class FamilySettings:
    """How an engine runs as one CPU family (module docstring)."""

    family: CpuFamily
    needs: tuple[str, ...]  # /proc/cpuinfo flags the hardware must have
    onednn_isa: str | None  # ONEDNN_MAX_CPU_ISA (None: oneDNN's own pick)
    amx: bool  # what torch.cpu._is_amx_tile_supported answers (vLLM: SGL's GEMM, AMX attention)
    avx512_bf16: bool  # torch.cpu._is_avx512_bf16_supported (vLLM's kernel build)
    avx512: bool  # torch.cpu._is_avx512_supported (vLLM's kernel build)

    def environment(self) -> dict[str, str]:
        """The variables to set before the engine (and its oneDNN) first runs."""
        return {"ONEDNN_MAX_CPU_ISA": self.onednn_isa} if self.onednn_isa else {}


FAMILIES: dict[CpuFamily, FamilySettings] = {
    CpuFamily.AMX: FamilySettings(CpuFamily.AMX, ("amx_tile", "amx_bf16", "avx512_bf16"), None, True, True, True),
    CpuFamily.AVX512_BF16: FamilySettings(CpuFamily.AVX512_BF16, ("avx512f", "avx512_bf16"), "AVX512_CORE_BF16", False, True, True),
    CpuFamily.AVX512: FamilySettings(CpuFamily.AVX512, ("avx512f", "avx512bw", "avx512vl"), "AVX512_CORE", False, False, True),
    CpuFamily.AVX2: FamilySettings(CpuFamily.AVX2, ("avx2", "fma"), "AVX2", False, False, False),
}
ISA_CHOICES = ("auto", *(str(f) for f in CpuFamily))  # auto: this machine's own family


PORTABLE_BUILD = "_C_AVX2"  # vLLM's portable kernel library: every x86 CPU runs it (its attention: no FMA contraction)


def engine_kernel_build() -> str:
    """Which of vLLM's CPU kernel libraries this process's engine loads (vllm/platforms/cpu.py import_kernels asks
    ``torch.cpu``, which ``family_settings`` can answer for another family): the name the dump records."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return f"AVX2 ({PORTABLE_BUILD})"  # the name attention_merge_fused reads the build by
    return "AVX512+BF16 (_C)" if torch.cpu._is_avx512_bf16_supported() else "AVX512 (_C_AVX512)"


def attention_merge_fused(kernels: str | None) -> bool:
    """Whether the kernel build ``kernels`` (``engine.kernels`` of a dump, e.g. ``AVX2 (_C_AVX2)``) fuses its CPU
    attention's rescale across KV tiles and its split-KV merge (``a * f + b`` in one rounding): the AVX-512 builds
    do; the portable build multiplies and then adds (its attention is not contracted to FMA, though the library holds
    FMA instructions elsewhere; held against vLLM's op on an AVX2 EPYC: under the fused form a split decode row's bf16
    output parts by an ulp now and then)."""
    return PORTABLE_BUILD not in str(kernels)


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def runnable_families(flags: set[str] | None = None) -> list[CpuFamily]:
    """The families an engine on this CPU can run as, widest first."""
    have = cpu_flags() if flags is None else flags
    return [family for family, settings in FAMILIES.items() if set(settings.needs) <= have]


def native_family(flags: set[str] | None = None) -> CpuFamily:
    """This CPU's own family: the widest it runs."""
    runnable = runnable_families(flags)
    if not runnable:
        raise PrecisionError("this CPU has none of the x86 families vLLM's CPU build runs (AVX2 and FMA at least)")
    return runnable[0]


def family_settings(isa: str, flags: set[str] | None = None) -> FamilySettings:
    """The settings of ``--isa`` (``auto``: this machine's family), refused in one line where this CPU cannot run it."""
    if isa not in ISA_CHOICES:
        raise PrecisionError(f"--isa {isa!r}: one of {', '.join(ISA_CHOICES)}")
    have = cpu_flags() if flags is None else flags
    family = native_family(have) if isa == "auto" else CpuFamily(isa)
    settings = FAMILIES[family]
    missing = [flag for flag in settings.needs if flag not in have]
    if missing:
        raise PrecisionError(
            f"--isa {isa}: this CPU lacks {', '.join(missing)}, so an engine here cannot run as {family}; it can run as "
            f"{', '.join(str(f) for f in runnable_families(have)) or 'none of the families'}"
        )
    if family == native_family(have):  # the machine's own family: oneDNN picks as it does for the engine's users, uncapped
        return replace(settings, onednn_isa=None)
    return settings
