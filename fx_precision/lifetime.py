"""No process outlives the run that started it, and a stop signal stops a run in one piece.

    die_with_parent(sig)     Linux ``prctl(PR_SET_PDEATHSIG)``: this process receives ``sig`` when its parent exits
                             (a rank when the run's parent or fork server goes, an engine when its rank goes)
    stop_on_signals()        SIGTERM and SIGINT raise ``Stopped`` in the main thread (finally blocks run: files are
                             removed, children are stopped); restored on exit
    Stopped                  the signal as an exception (a BaseException: ``except Exception`` does not swallow it)
    process_alive(pid)       whether a process of that id runs (another user's counts as running): what the owner
                             of a left-over file in /dev/shm or a run directory is judged by

Used by the rank runner (``ranks.py``), the engine server (``engines/serve.py``) and the on-policy loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType

PR_SET_PDEATHSIG = 1


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGINT) received by a run's process."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: signal 0 reaches it (another user's process runs too, not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; elsewhere nothing happens). A parent
    already gone when this runs (adopted by init) ends this process at once."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def _raise_stopped(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals(*signals: int) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT (or ``signals``) raise ``Stopped`` (main thread only; elsewhere a no-op)."""
    chosen = signals or (signal.SIGTERM, signal.SIGINT)
    try:
        previous = {s: signal.signal(s, _raise_stopped) for s in chosen}
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
