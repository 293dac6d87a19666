"""The on-policy loop under faults, against a live vLLM, each run `fx-precision onpolicy` in its own process as a user
starts it (FSDP2 on 2 gloo ranks unless said):

    SIGTERM / SIGINT to the parent alone     stops the ranks and the engine in seconds, DIR at the last complete step
    SIGKILL to a rank (also while it saves)  the run ends in one line naming the rank; no half-written step stays
    SIGSTOP / SIGKILL to the engine          a stopped engine ends the run after its call's time limit or 30 s without a
                                             heartbeat (the default limits: within two minutes), a dead one at once
    NaN weights                              refused before anything starts; a rollout of them says so and exits 1
    a live --overwrite                       refused, the live run's DIR untouched
    4 prompts of 600 tokens, 2 and 4 samples the group runs (no per-request seeds: the engine's own generator)

After every run: no process of it is left 5 s after it ended, no weights file of it in shared memory, one line on
stderr and no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fx_precision.engines.weights_file import PREFIX, owner_of
from fx_precision.tools.checkpoint import write_tiny_checkpoint

CLI = [sys.executable, "-m", "fx_precision.tools.cli"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
SHM = Path("/dev/shm")
# a run each test ends itself: a tiny step takes a fraction of a second on the diagnostic launch, so 100 steps can end
# before a test's signal (or a second run's preflight) reaches the run; the CLI's most never does
UNENDING = "100000"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dims = {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "intermediate_size": 224, "num_hidden_layers": 2}
    return write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("faults") / "ckpt", seed=21, dims=dims)


def _children(root: int) -> list[int]:
    """Every process whose ancestry reaches ``root`` (from /proc), ``root`` excluded."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found = []
    for pid in parents:
        p = pid
        while p in parents and p > 1:
            p = parents[p]
            if p == root:
                found.append(pid)
                break
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    status = Path("/proc") / str(pid) / "status"
    try:
        return "State:\tZ" not in status.read_text()
    except OSError:
        return False


class Run:
    """An onpolicy run in its own process (its own session, so the signals here reach only what a test sends them to)."""

    def __init__(self, checkpoint: Path, out: Path, *extra: str, defaults: bool = False) -> None:
        """``defaults``: the loop as ``fx-precision onpolicy`` runs with no launch flag (the engine at its defaults, the
        trainer compiled); else the diagnostic engine and the aot_eager trainer, which start faster."""
        self.out = out
        launch = () if defaults else ("--engine-launch", "eager", "--no-compiled")
        args = ["onpolicy", "--model", str(checkpoint), "--out", str(out), "--samples", "2", "--max-tokens", "4", "--prompt-lens",
                "8,12", *launch, *extra]  # fmt: skip
        self.shm_before = set(SHM.glob(f"*{PREFIX}*"))
        self.proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                     start_new_session=True)  # fmt: skip
        self.seen: set[int] = set()

    def steps(self) -> int:
        metrics = self.out / "metrics.json"
        try:
            return len(json.loads(metrics.read_text())["steps"]) if metrics.exists() else 0
        except (json.JSONDecodeError, OSError):
            return 0

    def wait_steps(self, n: int, limit: float = 300) -> None:
        deadline = time.monotonic() + limit
        while self.steps() < n:
            assert self.proc.poll() is None, f"the run ended early:\n{self.proc.stderr.read() if self.proc.stderr else ''}"
            assert time.monotonic() < deadline, f"no {n} steps in {limit} s"
            self.seen |= set(_children(self.proc.pid))
            time.sleep(0.1)
        self.seen |= set(_children(self.proc.pid))

    def processes(self, marker: str) -> list[int]:
        return [pid for pid in _children(self.proc.pid) if marker in _cmdline(pid)]

    def finish(self, limit: float = 120) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=limit)
        time.sleep(5)
        left = [pid for pid in self.seen if _alive(pid)]
        assert not left, f"processes outlived the run: {[_cmdline(p)[:120] for p in left]}"
        ours = {self.proc.pid} | self.seen  # a run of another test (pytest-xdist) may hold its own file meanwhile
        leaked = {p for p in set(SHM.glob(f"*{PREFIX}*")) - self.shm_before if owner_of(p) in ours or owner_of(p) is None}
        assert not leaked, f"left in shared memory: {leaked}"
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert "Traceback" not in err, err[-3000:]
        return self.proc.returncode, lines[-1] if lines else ""

    def last_step(self) -> int | None:
        last = self.out / "last"
        return int(Path(os.readlink(last)).name) if last.is_symlink() else None

    def assert_whole(self) -> None:
        """DIR at its last complete step: last -> steps/NNNN, nothing half-written beside it."""
        steps = self.out / "steps"
        assert not list(steps.glob(".*")) and not list(self.out.glob(".last.*")), list(steps.iterdir())
        if self.last_step() is not None:
            assert sorted(p.name for p in steps.iterdir()) == [f"{self.last_step():04d}"]
            assert (self.out / "last" / "checkpoint" / "model.safetensors").is_file() and (self.out / "last" / "rollout").is_dir()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_parent_stops_the_whole_run_in_seconds(checkpoint: Path, tmp_path: Path, signum: int) -> None:
    run = Run(checkpoint, tmp_path / "run", "--steps", UNENDING, "--mode", "audit", "--contract", "none")
    run.wait_steps(2)
    sent = time.monotonic()
    os.kill(run.proc.pid, signum)
    code, last = run.finish()
    assert time.monotonic() - sent < 30
    assert code == 128 + signum and f"stopped by {signal.Signals(signum).name}" in last, last
    assert f"holds step {run.last_step()}" in last and run.last_step() is not None and run.last_step() >= 1
    run.assert_whole()


def test_a_rank_killed_mid_run_ends_it_in_one_line_even_while_saving(checkpoint: Path, tmp_path: Path) -> None:
    """SIGKILL to rank 0 the moment it writes a step (its staging directory appears), else to rank 1 after two steps:
    the run ends naming the rank, the engine and the other rank go with it, DIR keeps the last complete step."""
    run = Run(checkpoint, tmp_path / "run", "--steps", UNENDING, "--mode", "audit", "--contract", "none")
    run.wait_steps(2)
    ranks = sorted(run.processes("multiprocessing"))
    staging = run.out / "steps"
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and time.monotonic() < deadline:  # rank 0 writes steps/.NNNN.writing-PID while it saves
        for path in staging.glob(".*.writing-*"):
            pid = int(path.name.rsplit("-", 1)[1])
            os.kill(pid, signal.SIGKILL)
            victim = pid
            break
        time.sleep(0.002)
    assert victim is not None and victim in ranks, (victim, ranks)
    code, last = run.finish()
    assert code == 2 and "was killed by SIGKILL" in last, last
    run.assert_whole()


def test_a_stalled_engine_ends_the_run_after_its_calls_limit(checkpoint: Path, tmp_path: Path) -> None:
    run = Run(checkpoint, tmp_path / "run", "--steps", UNENDING, "--mode", "audit", "--contract", "none", "--world-size", "1",
              "--engine-timeout", "5")  # fmt: skip
    run.wait_steps(1)
    engines = run.processes("fx_precision.engines.serve")
    assert engines
    os.kill(engines[0], signal.SIGSTOP)
    code, last = run.finish(limit=180)
    assert code == 2 and "the engine did not answer" in last and "--engine-timeout" in last, last
    run.assert_whole()


def test_an_engine_stopped_after_step_3_ends_the_run_within_two_minutes_at_the_default_limits(checkpoint: Path, tmp_path: Path) -> None:
    """No --engine-timeout: the engine's heartbeats stop with it, and the client tells that from a slow engine (beats
    arriving) after 30 s of silence, whatever the call's own limit (minutes at the defaults)."""
    run = Run(checkpoint, tmp_path / "run", "--steps", UNENDING, "--mode", "audit", "--contract", "none", "--world-size", "1",
              defaults=True)  # fmt: skip
    run.wait_steps(3, limit=600)  # the compiled engine's start and the trainer's Inductor compile come first
    engines = run.processes("fx_precision.engines.serve")
    assert engines
    stopped = time.monotonic()
    os.kill(engines[0], signal.SIGSTOP)
    code, last = run.finish(limit=120)
    assert time.monotonic() - stopped < 120
    assert code == 2 and "no heartbeat for 30 s (stopped by a signal)" in last, last
    run.assert_whole()


def test_an_engine_killed_mid_run_ends_it_at_once(checkpoint: Path, tmp_path: Path) -> None:
    run = Run(checkpoint, tmp_path / "run", "--steps", UNENDING, "--mode", "audit", "--contract", "none")
    run.wait_steps(1)
    os.kill(run.processes("fx_precision.engines.serve")[0], signal.SIGKILL)
    code, last = run.finish()
    assert code == 2 and "the engine process died" in last and "killed by SIGKILL" in last, last
    run.assert_whole()


def test_overwrite_of_a_live_run_is_refused_and_touches_nothing(checkpoint: Path, tmp_path: Path) -> None:
    run = Run(checkpoint, tmp_path / "run", "--steps", UNENDING, "--mode", "audit", "--contract", "none", "--world-size", "1")
    run.wait_steps(1)
    second = subprocess.run([*CLI, "onpolicy", "--model", str(checkpoint), "--out", str(run.out), "--overwrite", "--steps", "1"],
                            capture_output=True, text=True, env=ENV, check=False)  # fmt: skip
    assert run.proc.poll() is None, f"the first run ended before the second's check:\n{run.proc.stderr.read() if run.proc.stderr else ''}"
    assert second.returncode == 2 and "a live on-policy run" in second.stderr.strip().splitlines()[-1], second.stderr[-2000:]
    assert run.proc.poll() is None and run.steps() >= 1 and (run.out / "last").is_symlink()
    os.kill(run.proc.pid, signal.SIGTERM)
    code, _ = run.finish()
    assert code == 128 + signal.SIGTERM
    run.assert_whole()


def test_non_finite_weights_are_refused_and_a_rollout_of_them_says_so(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan"
    broken.mkdir()
    for f in checkpoint.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    name = next(n for n in weights if "embed_tokens" in n)  # tied: the output projection too
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(broken / "model.safetensors"))
    run = Run(broken, tmp_path / "run", "--steps", "2")
    code, last = run.finish()
    assert code == 2 and f"{name} holds" in last and "NaN or Inf" in last, last
    assert not (tmp_path / "run").exists()
    done = subprocess.run([*CLI, "rollout", "--launch", "eager",
            "--model", str(broken), "--prompt-lens", "9", "--out", str(tmp_path / "d")],
                          capture_output=True, text=True, env=ENV, check=False)  # fmt: skip
    assert done.returncode == 1 and "NOT USABLE" in done.stdout and name in done.stdout, done.stdout[-2000:]


def test_a_group_of_long_prompts_runs(checkpoint: Path, tmp_path: Path) -> None:
    """4 prompts of 600 tokens x G = 2 samples: more prompt tokens (4,800) than the engine's chunk budget (4,096), which
    vLLM's seeded requests could not chunk on a CPU generator; the loop samples from the engine's generator."""
    samples = 2
    done = subprocess.run([*CLI, "onpolicy", "--model", str(checkpoint), "--out", str(tmp_path / "run"), "--steps", "1",
                           "--samples", str(samples), "--max-tokens", "4", "--prompt-lens", "600,600,600,600", "--world-size", "1",
                           "--contract", "none", "--mode", "audit", "--engine-launch", "eager", "--no-compiled",
                           "--json", str(tmp_path / "run.json")],
                          capture_output=True, text=True, env=ENV, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads((tmp_path / "run.json").read_text())
    assert report["steps"][0]["tokens"] == 4 * samples * 4 and report["stopped"] is None
