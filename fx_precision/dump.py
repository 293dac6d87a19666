"""Dumps: every module call's float outputs (inputs on request), in execution order.

    with DumpRecorder(model, "out/train") as rec:      fxp.dump(model, ids, out="out/train")
        model(ids)

    out/train/                                  (under torch.distributed: out/train/rank{r}/ per rank)
    ├── manifest.json   {"version": 1, "model": "Qwen3_5ForCausalLM", "rank": 0, "world_size": 1,
    │                    "inputs": false, "device_type": "cpu", "autocast": "bf16" | null,
    │                    "calls": [{"fqn", "call", "start", "end"}],
    │                    "records": [{"fqn", "call", "io": "in" | "out", "path", "dtype", "shape", "file"}]}
    └── tensors/000017.pt   one tensor per record (torch.save; read back with torch.load(weights_only=True))

A record's ``path`` names the tensor inside the module's inputs (``args[0]``, ``kwargs.hidden_states``)
or output (``out``, ``out[0]``, ``out.logits``): nested tuples, dicts and ``ModelOutput``s. Calls are
numbered per module (``call``) and by when they start and end (``start``, ``end``): a call nests
inside another when its interval does. The root's inputs are always recorded (the token ids the
log-prob metrics need); other inputs only with ``inputs=True``.

It works on any ``nn.Module`` (a rollout engine's model too, in its own process) and under FSDP2.
In memory (``Dump``) a recorder can also keep each call's live arguments (``replay=True``), so a
module can be run again alone on them: the comparator's op-level drill-down.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fx_precision.census import iter_tensors
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError

DUMP_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CallInfo:
    """One call of one module: ``call`` counts that module's calls; ``start``/``end`` order all calls."""

    fqn: str
    call: int
    start: int
    end: int


@dataclass
class Record:
    fqn: str
    call: int
    io: str  # "in" | "out"
    path: str
    dtype: str
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None
    file: str | None = None

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.fqn, self.call, self.io, self.path)


@dataclass
class Dump:
    """Records in execution order (a call's records when it ends), its calls, and optional replays."""

    model: str
    records: list[Record] = field(default_factory=list)
    calls: list[CallInfo] = field(default_factory=list)
    inputs: bool = False
    rank: int = 0
    world_size: int = 1
    replays: dict[tuple[str, int], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict, repr=False)
    source: str = "in-process"
    device_type: str = "cpu"
    autocast: str | None = None  # the autocast dtype the forward ran under ("bf16"), None: no autocast

    def save(self, out: str | os.PathLike[str]) -> Path:
        """Write ``manifest.json`` and ``tensors/`` under ``out`` (``out/rank{r}`` when world_size > 1)."""
        root = Path(out) / f"rank{self.rank}" if self.world_size > 1 else Path(out)
        (root / "tensors").mkdir(parents=True, exist_ok=True)
        entries = []
        for i, record in enumerate(self.records):
            name = f"tensors/{i:06d}.pt"
            if record.tensor is not None:
                torch.save(record.tensor, root / name)
            entries.append({**{k: v for k, v in asdict(record).items() if k != "tensor"}, "file": name})
        manifest = {
            "version": DUMP_VERSION,
            "model": self.model,
            "rank": self.rank,
            "world_size": self.world_size,
            "inputs": self.inputs,
            "device_type": self.device_type,
            "autocast": self.autocast,
            "calls": [asdict(c) for c in self.calls],
            "records": entries,
        }
        (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
        return root


def load_dump(path: str | os.PathLike[str]) -> Dump | dict[int, Dump]:
    """A dump directory (one ``Dump``), or a directory of ``rank{r}`` dumps (``{rank: Dump}``)."""
    root = Path(path)
    if not root.is_dir():
        raise PrecisionError(f"dump {root}: no such directory; write one with fx_precision.dump or fx-precision dump")
    ranks = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("rank") and p.name[4:].isdigit())
    if not (root / MANIFEST).exists() and ranks:
        return {int(p.name[4:]): _load_one(p) for p in ranks}
    return _load_one(root)


def _load_one(root: Path) -> Dump:
    manifest_path = root / MANIFEST
    if not manifest_path.exists():
        raise PrecisionError(f"dump {root}: {MANIFEST} is missing; is this a dump directory (fx-precision dump writes one)?")
    try:
        data = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise PrecisionError(f"dump {manifest_path}: not valid JSON ({exc}); the dump is damaged, write it again") from None
    if not isinstance(data, dict) or data.get("version") != DUMP_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise PrecisionError(
            f"dump {manifest_path}: manifest version {version!r}, this fx_precision reads version {DUMP_VERSION}; "
            "write the dump again with this version"
        )
    try:
        dump = Dump(
            model=str(data["model"]),
            inputs=bool(data["inputs"]),
            rank=int(data["rank"]),
            world_size=int(data["world_size"]),
            calls=[CallInfo(**c) for c in data["calls"]],
            source=str(root),
            device_type=str(data.get("device_type", "cpu")),
            autocast=data.get("autocast"),
        )
        for entry in data["records"]:
            record = Record(
                entry["fqn"], int(entry["call"]), entry["io"], entry["path"], entry["dtype"], tuple(entry["shape"]), file=entry["file"]
            )
            file = root / record.file  # type: ignore[operator]
            if not file.exists():
                raise PrecisionError(f"dump {root}: tensor file {file} is gone (record {record.fqn} {record.io} {record.path})")
            tensor = torch.load(file, weights_only=True)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != record.shape or dtype_name(tensor.dtype) != record.dtype:
                got = f"{dtype_name(tensor.dtype)} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise PrecisionError(
                    f"dump {root}: {file} holds {got} but the manifest says {record.dtype} {record.shape}; the dump is damaged"
                )
            record.tensor = tensor
            dump.records.append(record)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PrecisionError):
            raise
        raise PrecisionError(f"dump {manifest_path}: malformed manifest ({type(exc).__name__}: {exc}); write the dump again") from None
    return dump


def _detach(value: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


class DumpRecorder:
    """Forward hooks recording every module call (see the module docstring); removed on exit.

    ``out``: a directory to write on exit (None: keep the ``Dump`` in memory, ``rec.dump``).
    ``inputs``: record every call's input tensors too. ``replay``: keep each call's live arguments
    (tensors cloned) so the comparator can run a module again alone.
    """

    def __init__(self, model: nn.Module, out: str | os.PathLike[str] | None = None, *, inputs: bool = False, replay: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise PrecisionError(f"DumpRecorder records an nn.Module, got {type(model).__name__}")
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.model = model
        self.out = out
        self.dump = Dump(type(model).__name__, inputs=inputs, rank=rank, world_size=world)
        self.replay = replay
        self._handles: list[Any] = []
        self._calls: Counter[str] = Counter()
        self._clock = 0
        self._open: dict[int, list[tuple[str, int, int]]] = {}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _record(self, fqn: str, call: int, io: str, value: Any, prefix: str) -> None:
        for path, tensor in iter_tensors(value, prefix):
            if io == "out" and not tensor.is_floating_point():
                continue
            self.dump.records.append(
                Record(fqn, call, io, path, dtype_name(tensor.dtype), tuple(tensor.shape), tensor.detach().cpu().clone())
            )

    def _pre_hook(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            call = self._calls[fqn]
            self._calls[fqn] += 1
            self._open.setdefault(id(module), []).append((fqn, call, self._tick()))
            if self.dump.inputs or fqn == "":
                self._record(fqn, call, "in", args, "args")
                self._record(fqn, call, "in", kwargs, "kwargs")
            if self.replay:
                self.dump.replays[(fqn, call)] = (module, _detach(args), _detach(kwargs))

        return hook

    def _hook(self) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            fqn, call, start = self._open[id(module)].pop()
            self.dump.calls.append(CallInfo(fqn, call, start, self._tick()))
            self._record(fqn, call, "out", output, "out")

        return hook

    def __enter__(self) -> DumpRecorder:
        device = next((t.device.type for t in self.model.parameters()), "cpu")
        self.dump.device_type = device if device in ("cpu", "cuda") else "cpu"
        if torch.is_autocast_enabled(self.dump.device_type):
            self.dump.autocast = dtype_name(torch.get_autocast_dtype(self.dump.device_type))
        try:
            for fqn, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(fqn), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._hook(), with_kwargs=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.remove()
        if exc_type is None and self.out is not None:
            self.dump.save(self.out)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def dump(model: nn.Module, *args: Any, out: str | os.PathLike[str] | None = None, inputs: bool = False, **kwargs: Any) -> Dump:
    """Run ``model(*args, **kwargs)`` once (under whatever autocast is active) and record it."""
    with torch.no_grad(), DumpRecorder(model, out, inputs=inputs) as recorder:
        model(*args, **kwargs)
    return recorder.dump
