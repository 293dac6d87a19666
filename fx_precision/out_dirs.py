"""Output directories written whole or not at all, that can never take their own input.

check_out_dir(out, kind, overwrite, replaceable, sources)   before anything runs: refuse what cannot be written whole
├── empty path, a file, a directory holding anything but a ``kind`` (``replaceable`` says what is one)
├── a ``kind`` already there without ``overwrite``
├── a path that is, holds or sits inside one of ``sources`` (what the run reads)
├── a path that is or holds the working directory (replacing it leaves the shell in a deleted directory)
├── an unwritable place
└── stale staging siblings of writers that died mid-write: removed
staging_path(root)           the sibling a directory is written to: ``.NAME.writing-PID-TOKEN`` (never inside ``root``)
replace_dir(staging, root)   one rename puts it in place; an old one is moved aside first, then removed
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from fx_precision.errors import PrecisionError
from fx_precision.lifetime import process_alive


def check_out_dir(out: str | os.PathLike[str], *, kind: str, overwrite: bool, replaceable: Callable[[Path], bool],
                  sources: Sequence[str | os.PathLike[str]] = ()) -> Path:  # fmt: skip
    """``out`` as a Path, or one PrecisionError naming the rule broken (module docstring)."""
    if str(out).strip() == "":
        raise PrecisionError(f"--out is empty; name the {kind} directory to write")
    root = Path(out)
    resolved = root.expanduser().resolve()
    for source in sources:
        src = Path(source).expanduser().resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            relation = "is" if resolved == src else ("sits inside" if src in resolved.parents else "holds")
            raise PrecisionError(f"--out {root} {relation} {source}, which this run reads; write the {kind} somewhere else")
    if root.exists() and not root.is_dir():
        raise PrecisionError(f"--out {root}: a file is there; a {kind} is a directory. Pick another path")
    if root.is_dir() and any(root.iterdir()):
        if not replaceable(root):
            raise PrecisionError(f"--out {root}: it holds files that are not a {kind}; refusing to replace them. Pick another path")
        if not overwrite:
            raise PrecisionError(f"--out {root} holds a {kind} already; pass --overwrite to replace it whole, or pick another path")
    cwd = Path.cwd().resolve()
    if root.exists() and (resolved == cwd or resolved in cwd.parents):
        raise PrecisionError(f"--out {root} is (or holds) the working directory; replacing it would leave it deleted under you. "
                             f"Run from elsewhere or pick another path")  # fmt: skip
    parent = resolved.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:  # tried, not asked (os.access says yes to root on read-only places)
        os.rmdir(tempfile.mkdtemp(prefix=f".{resolved.name}.probe-", dir=parent))
    except OSError as exc:
        raise PrecisionError(f"--out {root}: {parent} is not writable ({exc.strerror}); pick a directory you can write to") from None
    if resolved.parent.exists():
        remove_stale_staging(resolved)
    return root


def staging_path(root: Path) -> Path:
    """The sibling ``root`` is written to before one rename puts it in place: ``.NAME.writing-PID-TOKEN``."""
    return root.parent / f".{root.name}.writing-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def replace_dir(staging: Path, root: Path) -> None:
    """``staging`` becomes ``root``; an old ``root`` is moved aside first and removed after (between the two renames
    neither is at ``root``: never a mix)."""
    old = None
    if root.exists():
        old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(root, old)
    os.replace(staging, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_staging(root: Path) -> list[Path]:
    """Staging siblings of ``root`` whose writer (the PID in their name) is no longer running: removed, and returned."""
    removed = []
    for path in root.parent.glob(f".{root.name}.writing-*"):
        pid = path.name.rsplit(".writing-", 1)[-1].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
