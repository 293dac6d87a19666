"""What every committed benchmark result names: the command, the versions and the machine it ran on.

    provenance()   {"command", "fx_precision", "torch", "machine", "cpu", "cpu_family", "cores"}: merged into a result's
                   JSON (cpu_family: amx, avx512-bf16, avx512 or avx2, read from /proc/cpuinfo; one model name, "AMD EPYC",
                   stands for CPUs of several families)
    cpu_model()    the CPU's model name (/proc/cpuinfo), else platform.processor()
    cpu_family()   the CPU's widest x86 family vLLM's CPU build runs (engines/vllm/cpu_family.native_family)

Imported by the benchmark scripts, which run as ``python benchmarks/NAME.py`` (their directory is on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from fx_precision.engines.vllm.cpu_family import native_family
from fx_precision.errors import PrecisionError


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_family() -> str:
    try:
        return str(native_family())
    except PrecisionError as exc:
        return f"none ({exc})"


def provenance() -> dict[str, Any]:
    try:
        version = metadata.version("fx_precision")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "command": "python " + " ".join(sys.argv),
        "fx_precision": version,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_family": cpu_family(),
        "cores": os.cpu_count(),
    }
