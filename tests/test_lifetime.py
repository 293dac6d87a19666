"""No process outlives its run: a child dies with its parent, and a stop signal stops a run on real gloo ranks in
seconds, every rank's finally block run. (The on-policy loop under signals, against a live engine, is in
tests/engine/test_onpolicy_faults.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD_OF_A_PARENT_THAT_DIES = """
import os, sys, time
from fx_precision.lifetime import die_with_parent
pid = os.fork()
if pid == 0:
    die_with_parent()
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's (prctl)")
def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    note = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", CHILD_OF_A_PARENT_THAT_DIES, str(note)])
    deadline = time.monotonic() + 30
    while not note.exists() or not note.read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    child = int(note.read_text())
    assert _alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its parent"


RANKS_UNDER_A_SIGNAL = """
import os, sys, time
from fx_precision.lifetime import Stopped, stop_on_signals
from fx_precision.ranks import run_on_ranks
from tests.fsdp_workers import sleep_and_note_exit

try:
    with stop_on_signals():
        run_on_ranks(sleep_and_note_exit, 2, sys.argv[1])
except Stopped as exc:
    print("STOPPED", exc.signum, flush=True)
    sys.exit(128 + exc.signum)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_parent_stops_every_rank_in_seconds(signum: int, tmp_path: Path) -> None:
    """Two gloo ranks blocked in their work; the signal to the parent alone (not its process group): the parent stops the
    ranks, each runs its finally block (it notes its exit), and the parent reports the signal, within seconds."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", RANKS_UNDER_A_SIGNAL, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("started-*"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("started-*")]
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signum and f"STOPPED {int(signum)}" in out, (proc.returncode, out, err[-2000:])
    assert took < 20, took
    assert sorted(p.name for p in tmp_path.glob("exited-*")) == ["exited-0", "exited-1"]  # every rank's finally ran
    assert not [pid for pid in pids if _alive(pid)], "a rank outlived the run"
    assert "Traceback" not in err and "resource_tracker" not in err, err[-2000:]


def test_a_failed_rank_is_reported_as_the_failure_not_as_its_peers_stop(tmp_path: Path) -> None:
    """One rank raises; torch terminates its blocked peer (SIGTERM, which that peer reads as a stop). The caller gets the
    failure with its message, not a Stopped that would read as if the user had stopped the run."""
    from fx_precision.ranks import run_on_ranks
    from tests.fsdp_workers import fail_on_rank_one

    with pytest.raises(RuntimeError, match=r"rank 1 failed: ValueError: rank one's own failure"):
        run_on_ranks(fail_on_rank_one, 2, str(tmp_path))
    assert (tmp_path / "exited-0").exists()  # the peer was stopped, its finally block ran


RANK_ABORTED = """
import sys
from fx_precision.errors import PrecisionError
from fx_precision.ranks import run_on_ranks
from tests.fsdp_workers import abort_in_native_code_on_rank_one
try:
    run_on_ranks(abort_in_native_code_on_rank_one, 2, sys.argv[1])
except PrecisionError as exc:
    print("REFUSED", exc)
"""


def test_a_rank_a_fatal_signal_ends_is_one_line_and_its_python_stack_is_in_the_log(tmp_path: Path) -> None:
    """A rank killed by SIGABRT (a native heap check) ends the run with one line naming the rank and the signal, and the
    rank's own Python stack, down to the function that was running, is on stderr for the one who reads the log."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", RANK_ABORTED, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert "REFUSED rank 1 was killed by SIGABRT without a result" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "Fatal Python error: Aborted" in done.stderr and "abort_in_native_code_on_rank_one" in done.stderr, done.stderr[-2000:]
