"""vLLM's own GatedDeltaNet ops, loaded as the engine loads them when it runs as one CPU family, against the contract's
kernels: ``python gdn_ops_check.py FAMILY HEADS,VALUE_HEADS,DIM,WIDTH,STATE ...`` prints one ``RESULT`` line of JSON.

One process per family: each of vLLM's kernel builds (_C, _C_AVX512, _C_AVX2) registers its ops under the same names,
so a process holds one. The process runs as ``FAMILY`` (the engine's own switches, engines/vllm/session.py), loads the
build vLLM picks for it, reads which GDN kernels the probe follows there (``build``), and checks each shape:
``differ`` (the parts whose bits part from the followed kernels; empty: every bit equal) and ``differ_other`` (the
same ops against the other portable form: the probe must tell the two apart, or its equality proves nothing).
"""

from __future__ import annotations

import json
import sys

import torch


def main(family: str, shapes: list[str]) -> None:
    from fx_precision.engines.vllm import session
    from fx_precision.engines.vllm.cpu_family import engine_kernel_build, family_settings

    session._run_as(family_settings(family))
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from fx_precision.contract.gdn_form import PORTABLE, PORTABLE_FMA
    from fx_precision.engines.vllm.gdn_probe import _build_followed, _differing

    kernels = engine_kernel_build()
    build = _build_followed(kernels, torch.float32)
    other = {PORTABLE: PORTABLE_FMA, PORTABLE_FMA: PORTABLE}.get(build)
    results = []
    for shape in shapes:
        heads, value_heads, dim, width, state = shape.split(",")
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[state]
        args = (int(heads), int(value_heads), int(dim), int(width), dtype)
        seed = int(heads) * 1000 + int(dim)
        row = {"shape": shape, "differ": _differing(*args, torch.Generator().manual_seed(seed), build) if other else None}
        if other:
            row["differ_other"] = _differing(*args, torch.Generator().manual_seed(seed), other)
        results.append(row)
    print("RESULT " + json.dumps({"kernels": kernels, "build": build, "shapes": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
