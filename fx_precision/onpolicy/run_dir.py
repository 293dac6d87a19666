"""The on-policy run's directory: always the last complete step, never a half-written one.

    DIR/
    ├── .run.lock                  held (flock) by the run that writes DIR, for as long as it runs: one run per DIR
    ├── last -> steps/NNNN         a symlink, swapped in one rename once step NNNN is whole
    ├── steps/NNNN/checkpoint/     the bf16 weights the engine ran at that step (safetensors + config.json)
    ├── steps/NNNN/rollout/        that step's rollout, an engine dump (compare --model .../checkpoint --rollout ... works)
    ├── metrics.json               every finished step's metrics, replaced whole after each
    ├── engine.log                 the engine process's output
    └── plot.png                   reward and mismatch per step (--plot)

A step is written to ``steps/.NNNN.writing-PID`` first; a run stopped at any point leaves ``last`` at the last
complete step (older steps are removed once the link has moved); what a killed writer left half-written is removed
when its run ends (``remove_partial``) or by the next run in DIR. ``--overwrite`` replaces an earlier run, never a live
one: the lock says which.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import IO, Any

import torch

from fx_precision.errors import PrecisionError
from fx_precision.out_dirs import check_out_dir

CHECKPOINT_FILES = ("config.json", "generation_config.json")
LOCK = ".run.lock"  # what a checkpoint directory carries besides its weights


def is_run_dir(root: Path) -> bool:
    """DIR of an on-policy run (a finished one, a running one, or one that completed no step: its lock and log)."""
    return any((root / name).exists() for name in ("metrics.json", "steps", LOCK, "engine.log"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class RunDir:
    """DIR of one on-policy run (module docstring)."""

    def __init__(self, root: Path, lock: IO[str] | None = None) -> None:
        self.root = root
        self._lock = lock

    @classmethod
    def create(cls, out: str | os.PathLike[str], *, overwrite: bool, sources: tuple[str, ...]) -> RunDir:
        """``out`` checked (never a source, inside one or holding one; an earlier run only with ``overwrite``, never a
        live one), locked for this run, and made empty but for the lock, with its ``steps/``."""
        unfinished = Path(out).is_dir() and is_run_dir(Path(out)) and not (Path(out) / "last").is_symlink()
        root = Path(check_out_dir(out, kind="on-policy run", overwrite=overwrite or unfinished, replaceable=is_run_dir,
                                  sources=sources))  # fmt: skip
        root.mkdir(parents=True, exist_ok=True)
        lock = (root / LOCK).open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise PrecisionError(
                f"--out {out}: a live on-policy run (pid {holder}) is writing it; wait for it to end (or stop it), or pick another "
                "path. --overwrite replaces a finished run, never a running one"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        for entry in list(root.iterdir()):  # an earlier run, replaced with --overwrite (check_out_dir allowed it); the lock stays
            if entry.name != LOCK:
                _remove(entry)
        (root / "steps").mkdir()
        return cls(root, lock)

    def release(self) -> None:
        """The run is over: what a killed writer left half-written removed (where no step completed, everything but the
        engine's log: a run that never got going leaves what says why, and the next run takes DIR without
        --overwrite), and the lock released."""
        self.remove_partial()
        if not self.last.is_symlink():  # no step completed (the engine did not start, the first step failed): only its log stays
            for entry in list(self.root.iterdir()):
                if entry.name not in (LOCK, "engine.log"):
                    _remove(entry)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def remove_partial(self) -> None:
        """Staging directories and temporary files of writers that did not finish (a rank killed while saving)."""
        for path in [*(self.root / "steps").glob(".*.writing-*"), *self.root.glob(".last.*"), *self.root.glob(".metrics.json.*")]:
            _remove(path)

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

    def write_checkpoint(self, staging: Path, weights: dict[str, torch.Tensor], source_checkpoint: str) -> Path:
        """``staging/checkpoint``: the synced weights and the source checkpoint's config."""
        from fx_precision.engines.weights_file import write_weights

        target = staging / "checkpoint"
        target.mkdir()
        write_weights(weights, target / "model.safetensors")
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
