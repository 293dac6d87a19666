"""Run a function on N real gloo ranks on this machine (CPU), collect each rank's return value.

    run_on_ranks(fn, 2, *args)
    ├── rank 0: init_process_group("gloo") ; fn(rank=0, world_size=2, *args) ─▶ result[0]
    └── rank 1: init_process_group("gloo") ; fn(rank=1, world_size=2, *args) ─▶ result[1]

Under a launcher (``torchrun --nproc-per-node N -m fx_precision census ...``) the processes exist
already: each runs ``fn`` once in its own process, on the launcher's rendezvous (gloo; NCCL with
``--device cuda``, each rank on its LOCAL_RANK's GPU), and ``run_on_ranks`` returns ``[its own
result]``; the CLI prints on rank 0 only.

``fn`` must be importable by name (a module-level function); results must pickle.

No rank outlives its run: a rank dies with the process that forked it (``lifetime.die_with_parent``), a stop signal
in a rank raises ``lifetime.Stopped`` there (its finally blocks run), and a stop signal in the parent stops every rank
(SIGTERM, then SIGKILL after a grace period) before ``Stopped`` leaves ``run_on_ranks``. A rank that fails takes the
others down with it (torch's process context terminates them); one a fatal signal ends (SIGSEGV, SIGABRT: native code)
prints its Python stack to the log first (faulthandler) and is named with the signal in one line.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fx_precision.errors import PrecisionError
from fx_precision.lifetime import Stopped, die_with_parent, stop_on_signals

RENDEZVOUS = "rendezvous"  # the ranks' FileStore, in the run's temporary directory beside their results
GRACE = 15.0  # seconds a stopped rank has to end its own way (finally blocks: an engine stopped, files removed) before SIGKILL


def free_port() -> int:
    """A TCP port free at the time of asking (a launcher's --master-port; the spawned ranks meet on a file instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_group_backend() -> str:
    """``nccl`` when the verbs run their models on CUDA (``--device cuda`` sets FX_PRECISION_DEVICE), else gloo."""
    return "nccl" if os.environ.get("FX_PRECISION_DEVICE") == "cuda" else "gloo"


def rank_device(rank: int) -> torch.device:
    """This rank's device: its own GPU under ``--device cuda`` (the launcher's LOCAL_RANK), else the CPU."""
    if os.environ.get("FX_PRECISION_DEVICE") != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def require_device(device: str, where: str = "") -> None:
    """``--device cpu|cuda``: refused in one line where it is cuda and this torch sees no CUDA device; ``where``: how
    the verb runs there (" (under torchrun)")."""
    if device == "cuda" and not torch.cuda.is_available():
        raise PrecisionError(f"--device cuda: this torch sees no CUDA device; run on a GPU machine{where} or use --device cpu")


def use_device(device: str) -> None:
    """``--device cpu|cuda`` for the ranks started next: ``cuda`` ranks run on their own GPU with NCCL (they read
    FX_PRECISION_DEVICE)."""
    require_device(device, " (under torchrun)")
    if device == "cuda":
        os.environ["FX_PRECISION_DEVICE"] = "cuda"


# Ranks start from a fork server that has imported these once: a rank is a fork of it (a fraction of a
# second), not a fresh interpreter importing torch and transformers (seconds each). The server runs no
# Python thread when it forks; its one native thread is OpenBLAS's (numpy, which torch imports), whose
# own fork handler stops it. A rank takes the parent's environment as of the call (_worker), so it
# sees what a spawned rank would.
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "transformers", "fx_precision", "fx_precision.fsdp",
            "fx_precision.census", "fx_precision.backend", "fx_precision.tools.zoo", "fx_precision.ranks")  # fmt: skip


def _start_method() -> str:
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(list(_PRELOAD))  # read when the server starts (the first call); a module that is absent is skipped
    return "forkserver"


def _worker(rank: int, world_size: int, outdir: str, fn: Callable[..., Any], args: tuple[Any, ...], environ: dict[str, str]) -> None:
    die_with_parent(signal.SIGTERM)  # the fork server (or the parent) gone: this rank stops too
    faulthandler.enable()  # a rank a fatal signal ends (SIGSEGV, SIGABRT) prints its Python stack to the log first
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the fork server's from its start
    share = max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(min(share, int(environ["OMP_NUM_THREADS"])) if environ.get("OMP_NUM_THREADS", "").isdigit() else share)
    # the rendezvous is a file in the run's own directory, not a TCP port picked free beforehand: a port can be taken
    # between its pick and rank 0's bind (another run's ranks, an engine), and the run would fail for nothing
    dist.init_process_group(process_group_backend(), init_method=f"file://{os.path.join(outdir, RENDEZVOUS)}", rank=rank,
                            world_size=world_size)  # fmt: skip
    path = os.path.join(outdir, f"{rank}.pkl")
    try:
        with stop_on_signals():
            result: Any = ("ok", fn(rank, world_size, *args))
    except Stopped as exc:  # a stop signal: the finally blocks below fn ran; the parent says so in one line
        result = ("stopped", exc.signum)
    except PrecisionError as exc:  # bad input: the parent re-raises it as such, message only
        result = ("precision_error", str(exc))
    except BaseException as exc:  # anything else: ship it back with its traceback
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path, "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok":
        # nobody tears down before every rank is done with the store
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(1)  # a peer may be blocked in a collective; the parent reports the pickled error


def launched() -> bool:
    """Whether a launcher (torchrun, torchelastic) started this process as one of several ranks."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def launcher_rank() -> int:
    return int(os.environ.get("RANK", "0")) if launched() else 0


def _run_launched(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    if not dist.is_initialized():
        dist.init_process_group(process_group_backend())  # the launcher gives rank, world size and rendezvous
    return [fn(dist.get_rank(), dist.get_world_size(), *args)]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return their results.

    Under a launcher, run ``fn`` in this process on the launcher's ranks instead (``world_size`` is
    the launcher's) and return ``[this rank's result]``.
    """
    if launched():
        return _run_launched(fn, args)
    if world_size < 1:
        raise PrecisionError(f"world size {world_size} must be at least 1")
    if "ignore:resource_tracker:UserWarning" not in sys.warnoptions:  # ranks stopped mid-run leave semaphores it only warns of
        sys.warnoptions.append("ignore:resource_tracker:UserWarning")
    with tempfile.TemporaryDirectory() as outdir:
        context = mp.start_processes(
            _worker, args=(world_size, outdir, fn, args, dict(os.environ)), nprocs=world_size, start_method=_start_method(),
            join=False,
        )  # fmt: skip
        try:
            while not context.join(timeout=1.0):
                pass
        except mp.ProcessExitedException:
            pass  # the pickled per-rank results below say what went wrong
        except Stopped:
            _stop_all(context.processes)
            raise
        outcomes: dict[int, tuple[str, Any]] = {}
        for rank in range(world_size):
            path = os.path.join(outdir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        for status, value in outcomes.values():
            if status == "precision_error":
                raise PrecisionError(value)
        missing = [rank for rank in range(world_size) if rank not in outcomes]
        if missing:  # before the others' failures: a rank killed is why its peers' collectives failed or were stopped
            how = ", ".join(f"rank {rank} {_exit_status(context.processes[rank].exitcode)}" for rank in missing)
            raise PrecisionError(f"{how} without a result: the run ended there (a rank killed, or out of memory: see the log above)")
        for rank, (status, value) in outcomes.items():  # before "stopped": torch terminates a failed rank's peers
            if status == "error":
                raise RuntimeError(f"rank {rank} failed: {value}")
        stopped = [value for status, value in outcomes.values() if status == "stopped"]
        if stopped:
            raise Stopped(stopped[0])
        results = [outcomes[rank][1] for rank in range(world_size)]
    return results


def _exit_status(code: int | None) -> str:
    if code is None:
        return "did not end"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited {code}"


def _stop_all(processes: list[Any]) -> None:
    """SIGTERM to every rank still running (each ends its own way: Stopped), SIGKILL to those still there after GRACE."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + GRACE
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def cpu_mesh(world_size: int, shape: tuple[int, int] | None = None, device_type: str = "cpu") -> Any:
    """A 1-D mesh of ``world_size`` ranks (FSDP), or with ``shape=(R, S)`` a 2-D one (HSDP:
    ``R`` replicas, each sharded over ``S`` ranks; ``R * S == world_size``), on ``device_type``."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None:
        return init_device_mesh(device_type, (world_size,))
    if shape[0] * shape[1] != world_size:
        raise PrecisionError(
            f"mesh {shape[0]}x{shape[1]} needs {shape[0] * shape[1]} ranks, not {world_size}; "
            f"launch {shape[0] * shape[1]} ranks (--world-size / torchrun --nproc-per-node) or pick a mesh whose product is {world_size}"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (2, 2): replicas x shards."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise PrecisionError(f"--mesh {text!r}: expected RxS, replicas times shards, e.g. 2x2 (HSDP over 4 ranks)")
    return int(parts[0]), int(parts[1])
