"""Weights handed to a live engine in another process: one safetensors file, memory-backed where it can be.

    memory_backed_dir()           /dev/shm where it is writable, else the temp directory
    weights_file_name(owner)      fxp-engine-<owner pid>-<n>.safetensors: whose it is, in its name
    owner_of(path)                that owner pid (None: not a weights file's name)
    write_weights(weights, file)  written beside ``file`` and renamed into place (the engine never reads half a file)
    remove_stale(directory)       the files of owners that are gone (a run killed before it could remove its own)

The owner (engines/client.EngineProcess) removes its file when it closes, on every path; what a killed owner leaves is
removed by the next owner, which can prove the first is gone (its pid no longer runs).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import torch

from fx_precision.lifetime import process_alive

PREFIX = "fxp-engine-"
_COUNTER = itertools.count()


def memory_backed_dir() -> tuple[Path, bool]:
    """Where synced weights are written: /dev/shm (memory-backed) where it is writable, else the temp directory."""
    import tempfile

    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm, True
    return Path(tempfile.gettempdir()), False


def weights_file_name(owner: int | None = None) -> str:
    return f"{PREFIX}{owner or os.getpid()}-{next(_COUNTER)}.safetensors"


_NAME = re.compile(rf"^\.?{re.escape(PREFIX)}(\d+)-\d+\.safetensors(\.writing)?$")


def owner_of(path: Path) -> int | None:
    """The pid a weights file (or a half-written one) names as its owner; None where ``path`` is not one."""
    found = _NAME.match(path.name)
    return int(found.group(1)) if found else None


def remove_stale(directory: Path) -> list[Path]:
    """Remove weights files (and half-written ones) in ``directory`` whose owner process is gone; returns them."""
    removed = []
    for path in directory.glob(f"*{PREFIX}*"):
        owner = owner_of(path)
        if owner is not None and not process_alive(owner):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def write_weights(weights: dict[str, torch.Tensor], file: Path) -> None:
    """``weights`` as one safetensors file, written beside ``file`` and renamed into place."""
    from safetensors.torch import save_file

    tmp = file.with_name(f".{file.name}.writing")
    save_file({n: t.clone() if _shares_storage(t, weights, n) else t for n, t in weights.items()}, str(tmp))
    tmp.replace(file)


def _shares_storage(tensor: torch.Tensor, weights: dict[str, torch.Tensor], name: str) -> bool:
    """safetensors refuses tensors that share memory: a tied weight sent under two names is cloned for the second."""
    return any(other is tensor and n < name for n, other in weights.items())
