"""Run a function on N real gloo ranks on this machine (CPU), collect each rank's return value.

    run_on_ranks(fn, 2, *args)
    ├── rank 0: init_process_group("gloo") ; fn(rank=0, world_size=2, *args) ─▶ result[0]
    └── rank 1: init_process_group("gloo") ; fn(rank=1, world_size=2, *args) ─▶ result[1]

``fn`` must be importable by name (a module-level function); results must pickle.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fx_precision.errors import PrecisionError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    path = os.path.join(outdir, f"{rank}.pkl")
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except PrecisionError as exc:  # bad input: the parent re-raises it as such, message only
        result = ("precision_error", str(exc))
    except BaseException as exc:  # anything else: ship it back with its traceback
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path, "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok":
        # rank 0 hosts the TCPStore: nobody tears down before every rank is done with it
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(1)  # a peer may be blocked in a collective; the parent reports the pickled error


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return their results."""
    if world_size < 1:
        raise PrecisionError(f"world size {world_size} must be at least 1")
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), outdir, fn, args), nprocs=world_size, start_method="spawn")
        except mp.ProcessExitedException:
            pass  # the pickled per-rank results below say what went wrong
        outcomes: dict[int, tuple[str, Any]] = {}
        for rank in range(world_size):
            path = os.path.join(outdir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        for rank, (status, value) in outcomes.items():
            if status == "precision_error":
                raise PrecisionError(value)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed: {value}")
        missing = [rank for rank in range(world_size) if rank not in outcomes]
        if missing:
            raise RuntimeError(f"rank(s) {missing} died without a result (see their stderr above)")
        results = [outcomes[rank][1] for rank in range(world_size)]
    return results


def cpu_mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))
