"""What every committed benchmark result names: the command, the versions and the machine it ran on.

    provenance()   {"command", "fx_precision", "torch", "machine", "cpu", "cores"}: merged into a result's JSON
    cpu_model()    the CPU's model name (/proc/cpuinfo), else platform.processor()

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


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


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
        "cores": os.cpu_count(),
    }
