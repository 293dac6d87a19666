"""The trainer's end of a live engine in its own process and environment (engines/serve.py).

    engine_python(explicit)            the engine environment's Python: --engine-python, $FXP_ENGINE_PYTHON,
                                       ./.venv-engine/bin/python, or this one where the engine imports
    EngineProcess(python, cfg, log)    started, serving one checkpoint; its output goes to ``log``
    ├── generate(prompts, samples, max_tokens, temperature, seed)  -> Generation (no sampled logits: they stay there)
    ├── probe()                        -> EngineContract of the last generation (each new call read once)
    ├── load_weights(file)             -> (seconds, digest): a safetensors file loaded in place
    └── close()

An engine that dies is one PrecisionError naming the request, its exit status and the last line of its log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch

from fx_precision.contract import EngineContract
from fx_precision.dump import Sequence as TokenSequence
from fx_precision.engines.adapter import Generation, RolloutConfig
from fx_precision.errors import PrecisionError

ENGINE_ENV_DIR = ".venv-engine"  # where python -m fx_precision.tools.engine_env puts it by default


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


class EngineProcess:
    """A live engine in its own process (module docstring)."""

    def __init__(self, python: str, cfg: RolloutConfig, log: Path) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file: IO[str] = log.open("a")
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [python, "-m", "fx_precision.engines.serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
            text=True, env=env,
        )  # fmt: skip
        config = asdict(cfg)
        config["prompts"] = [list(p) for p in cfg.prompts]
        try:
            self.info: dict[str, Any] = self.request("start", config=config)["info"]
        except BaseException:
            self.close()
            raise

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self.proc.stdin is None or self.proc.stdout is None or self.proc.poll() is not None:
            raise self._died(op)
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            raise self._died(op) from None
        if not line:
            raise self._died(op)
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise PrecisionError(f"engine ({op}): {reply['error']}")
        return reply

    def _died(self, op: str) -> PrecisionError:
        code = self.proc.wait(timeout=30) if self.proc.poll() is None else self.proc.returncode
        self._log_file.flush()
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()] if self.log.exists() else []
        last = lines[-1][:300] if lines else "(no output)"
        return PrecisionError(f"the engine process died during {op} (exit {code}): {last}; its log is {self.log}")

    def generate(self, prompts: list[tuple[int, ...]], samples: int, max_tokens: int, temperature: float, seed: int) -> Generation:
        got = self.request("generate", prompts=[list(p) for p in prompts], samples=samples, max_tokens=max_tokens,
                           temperature=temperature, seed=seed)  # fmt: skip
        sequences = [TokenSequence(tuple(int(t) for t in tokens), int(prompt_len)) for tokens, prompt_len in got["sequences"]]
        logprobs = [torch.tensor(lp, dtype=torch.float32) for lp in got["logprobs"]]
        steps = [[(int(p), int(t)) for p, t in rows] for rows in got["steps"]]
        calls = [(int(a), int(b)) for a, b in got["logits_calls"]]
        return Generation(sequences, logprobs, steps, calls, float(got["seconds"]), got.get("extra") or {}, None, temperature)

    def probe(self) -> tuple[EngineContract, float]:
        got = self.request("probe")
        self.info = got.get("info", self.info)
        contract = EngineContract.from_dict(got["contract"])
        contract.check_evidence()
        return contract, float(got["seconds"])

    def load_weights(self, file: Path) -> tuple[float, str]:
        got = self.request("load_weights", path=str(file))
        return float(got["seconds"]), str(got["digest"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("close")
                self.proc.wait(timeout=60)
            except (PrecisionError, subprocess.TimeoutExpired, OSError, ValueError):
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
