"""The trainer's end of a live engine in its own process and environment (engines/serve.py, engines/protocol.py).

    engine_python(explicit)            the engine environment's Python: --engine-python, $FXP_ENGINE_PYTHON,
                                       ./.venv-engine/bin/python, or this one where the engine imports
    EngineProcess(python, cfg, log, timeouts)     started, serving one checkpoint; its output goes to ``log``. The same
    │                                  interface as an in-process session (engines/adapter.py EngineSession):
    ├── generate(SamplingRequest)      -> Generation (its sampled logits stay in the engine: the probe's evidence)
    ├── probe(generation)              -> EngineContract of that generation, the last one (each new call read once)
    ├── load_weights(named tensors)    -> digest: written to a memory-backed file this process owns, loaded in place
    ├── dump_last(path, ...)           the last generation as an engine dump (what fx-precision rollout writes)
    ├── describe()                     how the engine runs
    └── close()                        the engine stopped, its weights file removed (also on every failure)

Every call has a time limit derived from what it is (``EngineTimeouts``): an engine that does not answer in time is
killed and the call is one PrecisionError naming it. The engine beats once a second on a pipe (engines/serve.py): one
silent for ``SILENT`` seconds (stopped with SIGSTOP, hung) is killed then, whatever its call's limit, while a slow one
(beats arriving) has its limit; an engine that
dies is one PrecisionError naming the call, its exit status and the last line of its log. The engine runs in its own
session (a terminal's Ctrl-C reaches the trainer, which stops it) and dies with the process that started it.
"""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from fx_precision.contract import EngineContract
from fx_precision.engine_description import EngineDescription
from fx_precision.engines import protocol
from fx_precision.engines.adapter import Generation, ModulePass, RolloutConfig, SamplingRequest
from fx_precision.engines.serve import HEARTBEAT_FD
from fx_precision.errors import PrecisionError

ENGINE_ENV_DIR = ".venv-engine"  # where python -m fx_precision.tools.engine_env puts it by default
DEFAULT_TIMEOUT = 300.0  # seconds: the base of every engine call's limit (--engine-timeout)
START = 600.0  # seconds an engine has to start at least (vLLM imports, loads and compiles)
SILENT = 30.0  # seconds without a heartbeat after which an engine is stopped or hung, not slow
SILENCE = object()  # _read_line: the engine went silent


def engine_python(explicit: str | None = None) -> str:
    """The Python of the engine's environment (module docstring), or one error saying how to make one."""
    for candidate in (explicit, os.environ.get("FXP_ENGINE_PYTHON")):
        if candidate:
            if not Path(candidate).is_file():
                raise PrecisionError(f"--engine-python {candidate}: no such file; pass the engine environment's bin/python")
            return candidate
    local = Path(ENGINE_ENV_DIR) / "bin" / "python"
    if local.is_file():
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise PrecisionError(
        "no engine environment: build one with python -m fx_precision.tools.engine_env .venv-engine (or pass --engine-python "
        "PATH, or set FXP_ENGINE_PYTHON)"
    )


@dataclass(frozen=True)
class EngineTimeouts:
    """Each engine call's time limit in seconds, from ``base`` (--engine-timeout): probing and dumping take ``slow`` times
    the base, starting (imports, loading, the first compile) that and at least ``START`` seconds; a generation the
    base plus ``per_token`` seconds for every token it prefills or samples; closing a minute."""

    base: float = DEFAULT_TIMEOUT
    slow: float = 4.0
    per_token: float = 0.05

    def __post_init__(self) -> None:
        if not (isinstance(self.base, (int, float)) and 1.0 <= float(self.base) <= 86400.0):
            raise PrecisionError(f"--engine-timeout {self.base!r}: seconds between 1 and 86400")

    def of(self, request: protocol.Message) -> float:
        if isinstance(request, protocol.Generate):
            tokens = sum(len(p) + request.max_tokens for p in request.prompts) * max(1, request.samples)
            return self.base + self.per_token * tokens
        if isinstance(request, protocol.Start):
            return max(START, self.base * self.slow)
        if isinstance(request, (protocol.Probe, protocol.DumpLast)):
            return self.base * self.slow
        if isinstance(request, protocol.Close):
            return 60.0
        return self.base


class EngineProcess:
    """A live engine in its own process (module docstring)."""

    def __init__(self, python: str, cfg: RolloutConfig, log: Path, timeouts: EngineTimeouts | None = None,
                 weights_dir: Path | None = None) -> None:  # fmt: skip
        from fx_precision.engines.weights_file import memory_backed_dir, remove_stale, weights_file_name

        self.log = log
        self.timeouts = timeouts or EngineTimeouts()
        directory = weights_dir or memory_backed_dir()[0]
        remove_stale(directory)  # what a killed run left there (its owner is gone)
        self.weights_file = directory / weights_file_name()
        self._last: Generation | None = None
        self._buffer = b""
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file: IO[str] = log.open("a")
        self._beats, beat_end = os.pipe()  # the engine's heartbeats (engines/serve.py start_heartbeat)
        os.set_blocking(self._beats, False)
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1", HEARTBEAT_FD: str(beat_end)}
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "fx_precision.engines.serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
                env=env, pass_fds=(beat_end,),
                start_new_session=True,  # a terminal's Ctrl-C reaches the trainer, which stops the engine in order
            )  # fmt: skip
        finally:
            os.close(beat_end)
        self._last_beat = time.monotonic()
        try:
            started = self._call(protocol.Start.of(cfg))
            assert isinstance(started, protocol.Started)
            self.description: EngineDescription = started.description()
        except BaseException:
            self.close()
            raise

    def _call(self, request: protocol.Message) -> protocol.Message:
        if self.proc.stdin is None or self.proc.stdout is None or self.proc.poll() is not None:
            raise self._died(request.op)
        try:
            self.proc.stdin.write(protocol.encode(request).encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(request.op) from None
        limit = self.timeouts.of(request)
        self._heard()
        self._last_beat = time.monotonic()  # silence counts from the request on
        line = self._read_line(time.monotonic() + limit)
        if line is SILENCE:
            state = self._state()
            self._kill()
            raise PrecisionError(
                f"the engine stopped answering {request.op}: no heartbeat for {SILENT:.0f} s ({state}), so it was stopped; its "
                f"log is {self.log}"
            )
        if line is None:
            self._kill()
            raise PrecisionError(
                f"the engine did not answer {request.op} within {limit:.0f} s (stalled, stopped or deadlocked) and was stopped; its "
                f"log is {self.log}. A slower machine or model needs a longer --engine-timeout (now {self.timeouts.base:.0f} s)"
            )
        if not isinstance(line, str) or not line:
            raise self._died(request.op)
        return protocol.decode_reply(request, line)

    def _heard(self) -> bool:
        """Whether heartbeats arrived since the last look (read and dropped)."""
        heard = False
        while True:
            try:
                chunk = os.read(self._beats, 4096)
            except BlockingIOError:
                return heard
            if not chunk:  # the engine's end closed (it exited): its reply stream says how
                return heard
            heard = True

    def _state(self) -> str:
        """What the silent engine's process is doing, from /proc: stopped by a signal, or running without a beat."""
        try:
            state = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "its state unknown"
        return "stopped by a signal" if state in ("T", "t") else f"hung: process state {state}"

    def _read_line(self, deadline: float) -> str | object | None:
        """The next reply line; "" at the end of the stream (the engine exited), None past ``deadline``, ``SILENCE`` where
        the engine has not beaten for ``SILENT`` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return None
            if now - self._last_beat > SILENT:
                return SILENCE
            ready, _, _ = select.select([fd, self._beats], [], [], min(left, 1.0))
            if self._beats in ready and self._heard():
                self._last_beat = time.monotonic()
            if fd not in ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _died(self, op: str) -> PrecisionError:
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
            code = self.proc.returncode
        self._log_file.flush()
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()] if self.log.exists() else []
        last = lines[-1][:300] if lines else "(no output)"
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
        return PrecisionError(f"the engine process died during {op} ({how}): {last}; its log is {self.log}")

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL reaches a stopped (SIGSTOP) process too
        self.proc.wait()

    def generate(self, request: SamplingRequest) -> Generation:
        reply = self._call(protocol.Generate.of(request))
        assert isinstance(reply, protocol.Generated)
        self._last = reply.generation()
        return self._last

    def probe(self, generation: Generation, module_pass: ModulePass | None = None) -> EngineContract:
        """The contract of ``generation``, which must be this engine's last (the probe reads its calls there)."""
        if generation is not self._last or module_pass is not None:
            raise PrecisionError("EngineProcess.probe reads the engine's last generation, without a module pass: pass that one")
        reply = self._call(protocol.Probe())
        assert isinstance(reply, protocol.Probed)
        self.description = reply.description()
        contract = EngineContract.from_dict(reply.contract)
        contract.check_evidence()
        return contract

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        """``weights`` (checkpoint names, bf16) loaded by the engine in place, through a memory-backed file this process
        owns and removes at close; returns the engine's digest of what it loaded."""
        from fx_precision.engines.weights_file import write_weights

        write_weights(dict(weights), self.weights_file)
        reply = self._call(protocol.LoadWeights(str(self.weights_file)))
        assert isinstance(reply, protocol.WeightsLoaded)
        return reply.digest

    def dump_last(self, path: str, *, modules: bool = False, seed: int = 0, samples: int = 1, probe: bool = True) -> None:
        """The last generation as an engine dump at ``path`` (module records and the contract where asked)."""
        self._call(protocol.DumpLast(path, modules, seed, samples, probe))

    def describe(self) -> EngineDescription:
        return self.description

    def close(self) -> None:
        """The engine stopped (asked, then killed) and its weights file removed, whatever state it is in."""
        try:
            if self.proc.poll() is None:
                try:
                    self._call(protocol.Close())
                    self.proc.wait(timeout=60)
                except (PrecisionError, subprocess.TimeoutExpired, OSError, ValueError):
                    self._kill()
        finally:
            self.weights_file.unlink(missing_ok=True)
            self._log_file.close()
            if self._beats >= 0:
                os.close(self._beats)
                self._beats = -1

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
