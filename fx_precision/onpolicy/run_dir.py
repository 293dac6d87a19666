"""The on-policy run's directory: always the last complete step, never a half-written one.

    DIR/
    ├── last -> steps/NNNN         a symlink, swapped in one rename once step NNNN is whole
    ├── steps/NNNN/checkpoint/     the bf16 weights the engine ran at that step (safetensors + config.json)
    ├── steps/NNNN/rollout/        that step's rollout, an engine dump (compare --model .../checkpoint --rollout ... works)
    ├── metrics.json               every finished step's metrics, replaced whole after each
    ├── engine.log                 the engine process's output
    └── plot.png                   reward and mismatch per step (--plot)

A step is written to ``steps/.NNNN.writing-PID`` first; a run stopped at any point leaves ``last`` at the last
complete step (older steps are removed once the link has moved).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from fx_precision.out_dirs import check_out_dir

CHECKPOINT_FILES = ("config.json", "generation_config.json")  # what a checkpoint directory carries besides its weights


def is_run_dir(root: Path) -> bool:
    return (root / "metrics.json").exists() or (root / "steps").is_dir()


class RunDir:
    """DIR of one on-policy run (module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def create(cls, out: str | os.PathLike[str], *, overwrite: bool, sources: tuple[str, ...]) -> RunDir:
        """``out`` checked (never a source, inside one or holding one; an earlier run only with ``overwrite``) and
        made empty with its ``steps/``."""
        root = Path(check_out_dir(out, kind="on-policy run", overwrite=overwrite, replaceable=is_run_dir, sources=sources))
        if root.exists() and any(root.iterdir()):
            shutil.rmtree(root)  # check_out_dir allowed it: an earlier run, replaced with --overwrite
        (root / "steps").mkdir(parents=True, exist_ok=True)
        return cls(root)

    @property
    def engine_log(self) -> Path:
        return self.root / "engine.log"

    @property
    def last(self) -> Path:
        return self.root / "last"

    def staging(self, step: int) -> Path:
        path = self.root / "steps" / f".{step:04d}.writing-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def write_checkpoint(self, staging: Path, weights_file: Path, source_checkpoint: str) -> Path:
        """``staging/checkpoint``: the synced weights file and the source checkpoint's config."""
        target = staging / "checkpoint"
        target.mkdir()
        shutil.copyfile(weights_file, target / "model.safetensors")
        source = Path(source_checkpoint)
        for name in CHECKPOINT_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, target / name)
        return target

    def commit(self, step: int, staging: Path) -> Path:
        """``staging`` becomes ``steps/NNNN`` and ``last`` points at it (one rename each); the previous step goes."""
        final = self.root / "steps" / f"{step:04d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        previous = self.last.resolve() if self.last.is_symlink() else None
        link = self.root / f".last.{os.getpid()}"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("steps") / final.name)
        os.replace(link, self.last)
        if previous is not None and previous != final.resolve() and previous.exists():
            shutil.rmtree(previous, ignore_errors=True)
        return final

    def write_metrics(self, data: dict[str, Any]) -> None:
        tmp = self.root / f".metrics.json.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.root / "metrics.json")


def memory_backed_dir() -> tuple[Path, bool]:
    """Where synced weights are written: /dev/shm (memory-backed) where it is writable, else the temp directory."""
    import tempfile

    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm, True
    return Path(tempfile.gettempdir()), False
