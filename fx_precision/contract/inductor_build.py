"""Which Inductor compiled a model: what decides the arithmetic of the kernels it generates on this machine.

The compiled engine's norms, rotary and activations are Inductor's own C++ (vLLM's native forms): their
reduction order (the vector width a kernel's narrowest dtype picks), the roundings a fused kernel drops and
the compiler's contraction of multiply-adds follow from the torch build, the vector ISA Inductor picks on
this CPU and its C++ settings. The contract follows such an engine by giving the training side's Inductor the
same graph; it holds only where both sides' ``inductor_build()`` are the same string.
"""

from __future__ import annotations

import torch


def inductor_build() -> str:
    """This process's Inductor as the engine contract compares it: torch version, vector ISA, simdlen, FP contraction."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    contract_flag = config.cpp.enable_floating_point_contract_flag
    return f"torch {torch.__version__}, {isa or 'no vector ISA'}, simdlen {config.cpp.simdlen}, fp-contract {contract_flag}"
