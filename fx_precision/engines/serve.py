"""A live engine in its own process (its own environment), driven over JSON lines: what the on-policy loop talks to.

    python -m fx_precision.engines.serve          (in the engine's environment; engines/client.py starts it)

Each request is one line of ``engines/protocol.py`` (start, generate, probe, dump, load_weights, close) and gets one
reply line of the same schema. A failure is ``{"error": one line}`` and the server goes on. Replies go to the process's
original stdout; anything else the engine prints goes to stderr (the client's log file), so the protocol stream holds
replies only. The server dies with its parent (a parent-death signal, set at start): no engine outlives its trainer.
It beats once a second on a pipe of the client's (``start_heartbeat``): the client tells a stopped or hung engine (no
beat) from a slow one (beats arriving).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, TextIO

from fx_precision.engines import protocol
from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from fx_precision.engines.adapter import Generation, LocalSession


class EngineServer:
    """One engine session and its last generation (module docstring)."""

    def __init__(self) -> None:
        self.session: LocalSession | None = None
        self.generation: Generation | None = None

    @property
    def started(self) -> LocalSession:
        """The session ``start`` made (``handle`` refuses every other request before it)."""
        assert self.session is not None, "handle() refuses a request before start"
        return self.session

    def handle(self, request: protocol.Message) -> protocol.Message:
        if not isinstance(request, protocol.Start) and self.session is None:
            raise PrecisionError(f"engine server: {request.op} before start")
        handler = getattr(self, f"op_{request.op}")
        reply: protocol.Message = handler(request)
        return reply

    def op_start(self, request: protocol.Start) -> protocol.Started:
        from fx_precision.engines.preflight import engine_preflight

        cfg = request.rollout_config()
        checked = engine_preflight(cfg.model, cfg.engine, cfg.isa, live=True)
        if cfg.prompts:
            checked.check_prompts(cfg.prompts, cfg.max_tokens)
        self.session = checked.adapter.start(cfg)
        return protocol.Started(self.started.describe().to_dict())

    def op_generate(self, request: protocol.Generate) -> protocol.Generated:
        self.generation = self.started.generate(request.sampling())
        return protocol.Generated.of(self.generation)

    def op_probe(self, request: protocol.Probe) -> protocol.Probed:
        if self.generation is None:
            raise PrecisionError("engine server: probe before a generate (the probe reads the run's own calls)")
        started = time.perf_counter()
        contract = self.started.probe(self.generation, None)
        return protocol.Probed(contract.to_dict(), time.perf_counter() - started, self.started.describe().to_dict())

    def op_dump(self, request: protocol.DumpLast) -> protocol.Dumped:
        """The last generation as an engine dump at ``path`` (with ``modules``: every module's inputs and outputs of
        each sequence prefilled alone), probed where asked: what ``fx-precision rollout`` writes."""
        from fx_precision.engines.rollout import engine_dump

        if self.generation is None:
            raise PrecisionError("engine server: dump before a generate")
        g = self.generation
        module_pass = self.started.record_modules(g.sequences, g.temperature) if request.modules else None
        contract = self.started.probe(g, module_pass) if request.probe else None
        dump = engine_dump(self.started.config, self.started.describe(), g, module_pass, contract, request.seed, request.samples)
        dump.save(request.path)
        return protocol.Dumped(request.path)

    def op_load_weights(self, request: protocol.LoadWeights) -> protocol.WeightsLoaded:
        from safetensors.torch import load_file

        started = time.perf_counter()
        digest = self.started.load_weights(load_file(request.path).items())
        return protocol.WeightsLoaded(time.perf_counter() - started, digest)

    def op_close(self, request: protocol.Close) -> protocol.Closed:
        if self.session is not None:
            self.session.close()
        self.session = None
        return protocol.Closed()


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:600]


def serve(requests: TextIO, replies: TextIO) -> None:
    """Answer each request line with one reply line until ``close`` or the end of input."""
    server = EngineServer()
    for line in requests:
        if not line.strip():
            continue
        request: protocol.Message | None = None
        try:
            request = protocol.decode_request(line)
            reply: protocol.Message | dict[str, str] = server.handle(request)
        except PrecisionError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # the engine's own failure: one line, the server goes on
            reply = {"error": f"{type(exc).__name__}: {_one_line(exc)}"}
        replies.write(protocol.encode(reply))
        replies.flush()
        if isinstance(request, protocol.Close):
            return


HEARTBEAT_FD = "FXP_ENGINE_HEARTBEAT_FD"  # the pipe the client reads this process's heartbeats from (engines/client.py)
HEARTBEAT_EVERY = 1.0  # seconds between heartbeats


def _beat(fd: int) -> None:
    """A byte on ``fd`` every ``HEARTBEAT_EVERY`` seconds for as long as this process runs: busy in a kernel or a compile,
    it beats (torch's ops release the GIL); stopped (SIGSTOP) or hung with the GIL held, it does not. A full pipe (a
    client busy elsewhere) drops beats; a closed one (the client gone) ends the thread."""
    while True:
        try:
            os.write(fd, b".")
        except BlockingIOError:
            pass
        except OSError:
            return
        time.sleep(HEARTBEAT_EVERY)


def start_heartbeat() -> None:
    """Beat on the pipe the client passed (``HEARTBEAT_FD``), if it passed one."""
    import threading

    fd = os.environ.get(HEARTBEAT_FD)
    if fd and fd.isdigit():
        os.set_blocking(int(fd), False)
        threading.Thread(target=_beat, args=(int(fd),), name="fxp-engine-heartbeat", daemon=True).start()


def main() -> None:
    from fx_precision.lifetime import die_with_parent

    die_with_parent()
    start_heartbeat()
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol stream: replies only
    os.dup2(2, 1)  # whatever else is printed (the engine's own output, C code included) goes to the log
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
