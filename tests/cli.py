"""``fx-precision`` run in this process, as a test sees a command: exit status, stdout, stderr.

    run_cli("plan", "--model", "toy-decoder")  ->  CompletedProcess(args, returncode, stdout, stderr)

``main(argv)`` parses only ``argv`` and answers argument errors in milliseconds; a subprocess is for
tests where the process is the point (torchrun, the entry point, spawned ranks). An exception that
escapes ``main`` is written to stderr with its traceback and exit status 1, as the interpreter would.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

from fx_precision.ranks import free_port
from fx_precision.tools.cli import main


def run_cli(*args: str, cwd: str | os.PathLike[str] | None = None, timeout: int | None = None) -> subprocess.CompletedProcess[str]:
    """``fx-precision ARGS`` in process (``timeout`` is accepted for the subprocess form's signature)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int) and exc.code is not None:
                print(exc.code, file=err)
        except Exception:
            traceback.print_exc(file=err)
            code = 1
    return subprocess.CompletedProcess(["fx-precision", *args], int(code or 0), out.getvalue(), err.getvalue())


def run_torchrun(ranks: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node RANKS -m fx_precision ARGS`` on a free port (parallel test workers never share 29500)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--nproc-per-node", str(ranks), "--master-port", str(free_port()), "-m", "fx_precision", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
