"""Which Inductor compiled a model: what decides the arithmetic of the kernels it generates on this machine.

The compiled engine's norms, rotary and activations are Inductor's own C++ (vLLM's native forms): their
reduction order (the vector width a kernel's narrowest dtype picks), the roundings a fused kernel drops and
the compiler's contraction of multiply-adds follow from the torch build, the vector ISA Inductor picks on
this CPU and its C++ settings. The contract follows such an engine by giving the training side's Inductor the
same graph; it holds only where both sides' builds agree on torch, the vector ISA and FP contraction.

    inductor_build(simdlen)    "torch V, ISA, simdlen N, fp-contract F": the engine records its own
    following_simdlen(engine)  the simdlen that makes this process's Inductor pick the engine's ISA where it
                               picks another by default and this CPU runs the engine's (an engine run as the
                               avx2 family on an AVX-512 CPU: vLLM's kernel build and Inductor at 256 bits
                               while ATen keeps the machine's capability); None where nothing is to follow
    same_build(a, b)           torch, ISA and FP contraction equal (simdlen is how an ISA is chosen, not what)
"""

from __future__ import annotations

import torch


def inductor_build(simdlen: int | None = None) -> str:
    """This process's Inductor as the engine contract compares it: torch version, vector ISA, simdlen, FP contraction
    (``simdlen``: as it would be with ``torch._inductor.config.cpp.simdlen`` set to it)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    chosen = simdlen if simdlen is not None else config.cpp.simdlen
    with config.patch({"cpp.simdlen": chosen}):
        isa = pick_vec_isa()
    contract_flag = config.cpp.enable_floating_point_contract_flag
    return f"torch {torch.__version__}, {isa or 'no vector ISA'}, simdlen {chosen}, fp-contract {contract_flag}"


def _fields(build: str) -> tuple[str, ...]:
    return tuple(part for part in build.split(", ") if not part.startswith("simdlen "))


def same_build(a: str, b: str) -> bool:
    """Whether two builds generate the same arithmetic: torch, vector ISA and FP contraction equal."""
    return _fields(a) == _fields(b)


def following_simdlen(engine: str) -> int | None:
    """The ``cpp.simdlen`` under which this process's Inductor picks the engine's vector ISA, where its own pick differs
    and this CPU runs the engine's; None where the picks agree already or no width here picks it."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if same_build(inductor_build(), engine):
        return None
    for isa in valid_vec_isa_list():
        if same_build(inductor_build(isa.bit_width()), engine):
            return int(isa.bit_width())
    return None
