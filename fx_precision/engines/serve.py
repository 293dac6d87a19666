"""A live engine in its own process (its own environment), driven over JSON lines: what the on-policy loop talks to.

    python -m fx_precision.engines.serve          (in the engine's environment; engines/client.py starts it)

    request (one JSON line on stdin)                                  reply (one JSON line)
    {"op": "start", "config": {RolloutConfig fields}}                {"info": how the engine runs}
    {"op": "generate", "prompts", "samples", "max_tokens",           {"sequences": [[tokens, prompt_len]], "logprobs",
     "temperature", "seed"}                                            "steps", "logits_calls", "seconds"}
    {"op": "probe"}                                                   {"contract": EngineContract.to_dict()} of the last
                                                                        generation (only its new calls are read)
    {"op": "dump", "path", "modules", "seed", "samples"}              {"path"}: the last generation as an engine dump (what
                                                                        fx-precision rollout writes), module records on request
    {"op": "load_weights", "path": FILE}                              {"seconds", "digest"}: a safetensors file (memory-
                                                                        backed: /dev/shm) loaded in place, and the
                                                                        tensors_digest of what was loaded
    {"op": "close"}                                                   {} and the process exits

A failure is ``{"error": one line}`` and the server goes on. Replies go to the process's original stdout; anything
else the engine prints goes to stderr (the client's log file), so the protocol stream holds replies only. Log-probs
travel as JSON numbers (fp32 values, exactly: a double's shortest repr round-trips).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import fields
from typing import Any, TextIO

from fx_precision.errors import PrecisionError


class EngineServer:
    """One engine session and its last generation (module docstring)."""

    def __init__(self) -> None:
        self.session: Any = None
        self.generation: Any = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            raise PrecisionError(f"engine server: unknown op {op!r}")
        if op != "start" and self.session is None:
            raise PrecisionError(f"engine server: {op} before start")
        result: dict[str, Any] = handler(request)
        return result

    def op_start(self, request: dict[str, Any]) -> dict[str, Any]:
        from fx_precision.checkpoints import read_checkpoint_config
        from fx_precision.engines import engine_adapter
        from fx_precision.engines.adapter import RolloutConfig

        known = {f.name for f in fields(RolloutConfig)}
        config = dict(request.get("config") or {})
        unknown = sorted(set(config) - known)
        if unknown:
            raise PrecisionError(f"engine server: unknown config field(s) {unknown}")
        config["prompts"] = tuple(tuple(p) for p in config.get("prompts", ()))
        cfg = RolloutConfig(**config)
        adapter = engine_adapter(cfg.engine)
        refused = adapter.refuses(read_checkpoint_config(cfg.model).config)
        if refused:
            raise PrecisionError(f"--model {cfg.model}: {refused}")
        self.session = adapter.start(cfg)
        return {"info": self.session.describe()}

    def op_generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from fx_precision.engines.adapter import SamplingRequest

        prompts = tuple(tuple(int(t) for t in p) for p in request["prompts"])
        sampling = SamplingRequest(prompts, int(request["max_tokens"]), float(request["temperature"]), int(request["seed"]),
                                   int(request.get("samples", 1)))  # fmt: skip
        self.generation = self.session.generate(sampling)
        g = self.generation
        return {
            "sequences": [[list(s.tokens), s.prompt_len] for s in g.sequences],
            "logprobs": [lp.tolist() for lp in g.logprobs],
            "steps": g.steps,
            "logits_calls": g.logits_calls,
            "seconds": g.seconds,
            "extra": g.extra,
        }

    def op_probe(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.generation is None:
            raise PrecisionError("engine server: probe before a generate (the probe reads the run's own calls)")
        started = time.perf_counter()
        contract = self.session.probe(self.generation, None)
        return {"contract": contract.to_dict(), "seconds": time.perf_counter() - started, "info": self.session.describe()}

    def op_dump(self, request: dict[str, Any]) -> dict[str, Any]:
        """The last generation as an engine dump at ``path`` (with ``modules``: every module's inputs and outputs of
        each sequence prefilled alone), probed: what ``fx-precision rollout`` writes."""
        from fx_precision.engines.rollout import engine_dump

        if self.generation is None:
            raise PrecisionError("engine server: dump before a generate")
        g = self.generation
        module_pass = (
            self.session.record_modules(g.sequences, g.temperature, int(request.get("seed", 0))) if request.get("modules") else None
        )
        contract = self.session.probe(g, module_pass)
        dump = engine_dump(self.session.config, self.session.describe(), g, module_pass, contract, int(request.get("seed", 0)),
                           int(request.get("samples", 1)))  # fmt: skip
        dump.save(str(request["path"]), overwrite=bool(request.get("overwrite", False)))
        return {"path": str(request["path"])}

    def op_load_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        from safetensors.torch import load_file

        from fx_precision.checkpoints import tensors_digest

        started = time.perf_counter()
        weights = load_file(str(request["path"]))
        self.session.load_weights(weights.items())
        return {"seconds": time.perf_counter() - started, "digest": tensors_digest(weights.items())}

    def op_close(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.session is not None:
            self.session.close()
        self.session = None
        return {}


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:600]


def serve(requests: TextIO, replies: TextIO) -> None:
    """Answer each request line with one reply line until ``close`` or the end of input."""
    server = EngineServer()
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            reply = server.handle(request)
        except PrecisionError as exc:
            request, reply = {}, {"error": str(exc)}
        except Exception as exc:  # the engine's own failure: one line, the server goes on
            request, reply = {}, {"error": f"{type(exc).__name__}: {_one_line(exc)}"}
        replies.write(json.dumps(reply) + "\n")  # -inf log-probs travel as -Infinity (Python's JSON)
        replies.flush()
        if request.get("op") == "close":
            return


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol stream: replies only
    os.dup2(2, 1)  # whatever else is printed (the engine's own output, C code included) goes to the log
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
