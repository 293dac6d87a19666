"""What the engine suite's per-family tests share: the skip for a CPU family this machine cannot run as, and the GDN
kernel form the contract follows for each of vLLM's portable kernel builds."""

from __future__ import annotations

import pytest

from fx_precision.contract.gdn_form import PORTABLE, PORTABLE_FMA
from fx_precision.engines.vllm.cpu_family import FAMILIES, CpuFamily, cpu_flags, runnable_families

# run as each family, vLLM loads one portable build, whose generic GDN code the contract follows in one form (the native
# AVX-512 BF16 build, _C: tests/engine/test_gdn.py)
PORTABLE_GDN_BUILDS = {CpuFamily.AVX512: ("_C_AVX512", PORTABLE_FMA), CpuFamily.AVX2: ("_C_AVX2", PORTABLE)}


def skip_unless_runnable(family: CpuFamily) -> None:
    """Skip, naming the instructions, where this CPU lacks what ``family`` needs (held on a CPU that has them)."""
    if family not in runnable_families():
        missing = sorted(set(FAMILIES[family].needs) - cpu_flags())
        pytest.skip(f"this CPU lacks {', '.join(missing)}: an engine here cannot run as {family} (held on a CPU that has them)")
