"""Dumps: every module call's float outputs (inputs on request), in execution order, and per-token log-probs.

    with DumpRecorder(model, "out/train") as rec:      fxp.dump(model, ids, out="out/train")
        model(ids)

    out/train/                                  (several ranks: out/train/rank{r}/, one per rank, always)
    ├── manifest.json   {"version": 2, "model": "Qwen3ForCausalLM", "rank": 0, "world_size": 1,
    │                    "inputs": false, "device_type": "cpu", "autocast": "bf16" | null, "source": "...",
    │                    "engine": null | {"name": "vllm", "version", "dtype", "custom_ops", "attention", "isa",
    │                                      "rounding", "threads", ...},
    │                    "contract": null | {...what was detected about the engine},
    │                    "sequences": [{"tokens": [ids], "prompt_len": P}],        (token ids a log-prob is of)
    │                    "calls": [{"fqn", "call", "start", "end"}],
    │                    "records": [{"fqn", "call", "io", "path", "dtype", "shape", "file",
    │                                 "shard": null | {"dim", "rank", "world"}}]}
    └── tensors/000017.pt   one tensor per record (torch.save; read back with torch.load(weights_only=True))

``io`` is ``in`` / ``out`` (module calls) or ``logprob``: ``fqn="<logprobs>"``, ``path="seq[i]"``, the
fp32 log-prob of every token of sequence i but the first (``tokens[1:]``, prompt then generated).
A record's ``path`` names the tensor inside the module's inputs (``args[0]``, ``kwargs.hidden_states``)
or output (``out``, ``out[0]``, ``out.logits``). Calls are numbered per module (``call``) and by when
they start and end (``start``, ``end``): a call nests inside another when its interval does. The
root's inputs are always recorded (the token ids the log-prob metrics need).

A tensor-parallel engine writes one shard per rank: ``shard`` says along which dimension; ``load_dump``
of the parent directory joins the shards before anything is compared. A training side under
FSDP2/HSDP records full tensors on every rank; rank 0 speaks for them.

Writing is atomic: a dump is written to a hidden sibling and renamed into place, so an interrupted
write leaves the old dump or nothing, never a mix; an existing dump is replaced only with
``overwrite=True``. Reading trusts nothing: each tensor file must sit inside the dump, load with
``weights_only`` (no code), and have the shape and dtype its record says.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import zipfile
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fx_precision.callable_module import make_callable
from fx_precision.census import iter_tensors, module_class_name
from fx_precision.dtypes import dtype_name
from fx_precision.errors import PrecisionError, first_line
from fx_precision.out_dirs import check_out_dir, replace_dir, staging_path

DUMP_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
IO_KINDS = ("in", "out", "logprob")
LOGPROBS = "<logprobs>"  # the fqn of log-prob records


@dataclass(frozen=True)
class CallInfo:
    """One call of one module: ``call`` counts that module's calls; ``start``/``end`` order all calls."""

    fqn: str
    call: int
    start: int
    end: int


@dataclass(frozen=True)
class Shard:
    """This record is rank ``rank`` of ``world`` pieces of one tensor, split along ``dim``."""

    dim: int
    rank: int
    world: int


@dataclass
class Record:
    fqn: str
    call: int
    io: str  # "in" | "out" | "logprob"
    path: str
    dtype: str
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None
    file: str | None = None
    shard: Shard | None = None

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.fqn, self.call, self.io, self.path)


@dataclass(frozen=True)
class Sequence:
    """The token ids of one sequence (prompt then generated) whose log-probs a dump holds."""

    tokens: tuple[int, ...]
    prompt_len: int

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


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
    engine: dict[str, Any] | None = None  # how an inference engine ran (its own side of a comparison)
    contract: dict[str, Any] | None = None  # what was detected about the engine's arithmetic
    sequences: list[Sequence] = field(default_factory=list)
    routes: dict[str, Any] | None = None  # a training side's MoE routes against an engine's (routes.py; not written to disk)

    def add_logprobs(self, sequence: Sequence, logprobs: torch.Tensor) -> None:
        """Record the log-probs of ``sequence.tokens[1:]`` (one fp32 value per token)."""
        values = logprobs.detach().to(torch.float32).reshape(-1).cpu()
        if values.numel() != len(sequence.tokens) - 1:
            raise PrecisionError(
                f"log-probs of a sequence of {len(sequence.tokens)} tokens: expected {len(sequence.tokens) - 1} values (every token "
                f"but the first), got {values.numel()}"
            )
        index = len(self.sequences)
        self.sequences.append(sequence)
        self.records.append(Record(LOGPROBS, 0, "logprob", f"seq[{index}]", "fp32", tuple(values.shape), values))

    def logprob_records(self) -> list[Record]:
        return [r for r in self.records if r.io == "logprob"]

    def save(self, out: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``manifest.json`` and ``tensors/`` under ``out`` (``out/rank{r}`` when world_size > 1), atomically."""
        root = Path(out) / f"rank{self.rank}" if self.world_size > 1 else Path(out)
        check_out_path(root, overwrite=overwrite)
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_path(root)
        try:
            (staging / "tensors").mkdir(parents=True)
            entries = []
            for i, record in enumerate(self.records):
                name = f"tensors/{i:06d}.pt"
                if record.tensor is not None:
                    torch.save(record.tensor, staging / name)
                entry = {k: v for k, v in asdict(record).items() if k not in ("tensor", "shard")}
                entries.append({**entry, "file": name, "shard": asdict(record.shard) if record.shard else None})
            manifest = {
                "version": DUMP_VERSION,
                "model": self.model,
                "rank": self.rank,
                "world_size": self.world_size,
                "inputs": self.inputs,
                "device_type": self.device_type,
                "autocast": self.autocast,
                "source": self.source,
                "engine": self.engine,
                "contract": self.contract,
                "sequences": [{"tokens": list(s.tokens), "prompt_len": s.prompt_len} for s in self.sequences],
                "calls": [asdict(c) for c in self.calls],
                "records": entries,
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False))
            replace_dir(staging, root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return root


def is_dump_dir(root: Path) -> bool:
    """A dump directory (its manifest), or one of rank directories."""
    return (root / MANIFEST).exists() or any(p.name.startswith("rank") and (p / MANIFEST).exists() for p in root.iterdir())


def check_out_path(out: str | os.PathLike[str], *, overwrite: bool, sources: Seq[str | os.PathLike[str]] = ()) -> Path:
    """Refuse, before anything runs, a dump path that cannot be written whole (``out_dirs.check_out_dir``: a file, a
    directory holding anything but a dump, a dump without ``overwrite``, an unwritable place, the path of one of
    ``sources`` or of the working directory); stale staging siblings of dead writers are removed."""
    return check_out_dir(out, kind="dump", overwrite=overwrite, replaceable=is_dump_dir, sources=sources)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def is_engine_dump(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a dump an engine wrote (its manifest records how the engine ran)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return bool(json.loads(manifest.read_text()).get("engine"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def load_dump(path: str | os.PathLike[str]) -> Dump | dict[int, Dump]:
    """A dump directory (one ``Dump``), or a directory of ``rank{r}`` dumps (``{rank: Dump}``)."""
    root = Path(path)
    if not root.is_dir():
        raise PrecisionError(f"dump {root}: no such directory; write one with fx_precision.dump or fx-precision dump")
    ranks = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("rank") and p.name[4:].isdigit())
    if not (root / MANIFEST).exists() and ranks:
        return {int(p.name[4:]): _load_one(p) for p in ranks}
    return _load_one(root)


def join_ranks(ranks: dict[int, Dump]) -> tuple[Dump, str]:
    """One dump from per-rank dumps: shards joined along their dimension; full tensors from rank 0.
    Returns it and a note saying what was done."""
    first = ranks[min(ranks)]
    sharded = [r for d in ranks.values() for r in d.records if r.shard is not None]
    if not sharded:
        return first, f"{len(ranks)} rank dumps of full tensors: rank {min(ranks)} speaks for all"
    world = {r.shard.world for r in sharded if r.shard}
    if len(world) != 1 or sorted(ranks) != list(range(next(iter(world)))):
        raise PrecisionError(
            f"dump {first.source}: shards of {sorted(world)} ranks but rank directories {sorted(ranks)}; the dump is incomplete"
        )
    joined: list[Record] = []
    for record in first.records:
        if record.shard is None:
            joined.append(record)
            continue
        pieces = []
        for rank in sorted(ranks):
            match = next((r for r in ranks[rank].records if r.key == record.key), None)
            if match is None or match.shard is None or match.tensor is None:
                raise PrecisionError(f"dump {ranks[rank].source}: rank {rank} has no shard of {record.fqn} {record.io} {record.path}")
            pieces.append(match.tensor)
        tensor = torch.cat(pieces, dim=record.shard.dim)
        joined.append(Record(record.fqn, record.call, record.io, record.path, record.dtype, tuple(tensor.shape), tensor))
    dump = Dump(
        first.model,
        joined,
        list(first.calls),
        first.inputs,
        source=f"{first.source} (joined from {len(ranks)} ranks)",
        device_type=first.device_type,
        autocast=first.autocast,
        engine=first.engine,
        contract=first.contract,
        sequences=list(first.sequences),
    )
    return dump, f"{len(sharded)} shard records joined from {len(ranks)} ranks"


def _load_one(root: Path) -> Dump:
    manifest_path = root / MANIFEST
    if not manifest_path.exists():
        raise PrecisionError(f"dump {root}: {MANIFEST} is missing; is this a dump directory (fx-precision dump writes one)?")
    try:
        data = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PrecisionError(f"dump {manifest_path}: not valid JSON ({exc}); the dump is damaged, write it again") from None
    except OSError as exc:
        raise PrecisionError(f"dump {manifest_path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        version = data.get("version") if isinstance(data, dict) else None
        raise PrecisionError(
            f"dump {manifest_path}: manifest version {version!r}, this fx_precision reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; write the dump again with this version"
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
            engine=data.get("engine"),
            contract=data.get("contract"),
            sequences=[_sequence(s, i, manifest_path) for i, s in enumerate(data.get("sequences") or [])],
        )
        for entry in data["records"]:
            shard = Shard(**entry["shard"]) if entry.get("shard") else None
            record = Record(
                str(entry["fqn"]), int(entry["call"]), entry["io"], str(entry["path"]), str(entry["dtype"]), tuple(entry["shape"]),
                file=entry["file"], shard=shard,
            )  # fmt: skip
            if record.io not in IO_KINDS:
                raise PrecisionError(
                    f"dump {manifest_path}: record {record.fqn} {record.path} has io {record.io!r}; one of {', '.join(IO_KINDS)}"
                )
            record.tensor = _load_tensor(root, record)
            dump.records.append(record)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PrecisionError):
            raise
        raise PrecisionError(f"dump {manifest_path}: malformed manifest ({type(exc).__name__}: {exc}); write the dump again") from None
    return dump


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sequence(data: Any, index: int, manifest: Path) -> Sequence:
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list) or not _integer(data.get("prompt_len")):
        raise PrecisionError(f"dump {manifest}: sequences[{index}] is not {{tokens: [ids], prompt_len: int}}")
    tokens = data["tokens"]
    bad = next((t for t in tokens if not _integer(t) or t < 0), None)
    if bad is not None or not tokens:
        raise PrecisionError(f"dump {manifest}: sequences[{index}].tokens holds {bad!r}, not a token id (a non-negative integer)")
    if not 1 <= data["prompt_len"] <= len(tokens):
        raise PrecisionError(f"dump {manifest}: sequences[{index}].prompt_len {data['prompt_len']} is outside its {len(tokens)} tokens")
    return Sequence(tuple(tokens), int(data["prompt_len"]))


ENGINE_FIELDS: dict[str, tuple[type, ...]] = {  # what every engine dump records, and its type
    "name": (str,), "version": (str,), "threads": (int,), "split_kv": (bool,), "weights": (str,), "temperature": (int, float),
    "seed": (int,), "steps": (list,), "logits_calls": (list,),
}  # fmt: skip


def check_engine_dump(dump: Dump) -> None:
    """An engine's dump read against itself; any contradiction is one error naming the field, before anything runs:

    engine       every field a comparison reads, of its type (threads >= 1; steps [[position, token], ...] per
                 forward; logits calls [step, rows])
    log-probs    one record per sequence, each with one value per token but the first
    sequences    the tokens the engine's recorded steps fed (every row but the last sampled token, which is never
                 fed): a token edited in the sequences and not in the steps, or a sequence moved, is caught here
    """
    from fx_precision.contract.batch_rows import steps_of

    engine = dump.engine
    if not isinstance(engine, dict):
        raise PrecisionError(f"dump {dump.source}: not an engine dump (no engine record)")
    for key, kinds in ENGINE_FIELDS.items():
        value = engine.get(key)
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            shown = f"{value!r}"[:120]
            raise PrecisionError(f"dump {dump.source}: engine.{key} = {shown}; an engine dump records it as {kinds[0].__name__}")
    from fx_precision.engine_description import EngineDescription

    EngineDescription.of_run(engine, f"dump {dump.source}: engine")  # how the engine ran: each field its type
    if engine.get("logprobs", "raw") not in ("raw", "processed"):
        raise PrecisionError(f"dump {dump.source}: engine.logprobs = {engine.get('logprobs')!r}; raw or processed")
    if engine["threads"] < 1:
        raise PrecisionError(f"dump {dump.source}: engine.threads = {engine['threads']}; at least 1")
    top_k, top_p = engine.get("top_k", 0), engine.get("top_p", 1.0)  # the sampler's (absent: off, as dumps before them)
    if not _integer(top_k) or top_k < 0:
        raise PrecisionError(
            f"dump {dump.source}: engine.top_k = {top_k!r}; the sampler's top-k is a count of tokens, 0 for all: roll out again"
        )
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise PrecisionError(
            f"dump {dump.source}: engine.top_p = {top_p!r}; the sampler's top-p is a share in (0, 1], 1 for all: roll out again"
        )
    steps = engine["steps"]
    for i, rows in enumerate(steps):
        if not isinstance(rows, list) or any(not (isinstance(r, list) and len(r) == 2 and all(map(_integer, r))) for r in rows):
            raise PrecisionError(f"dump {dump.source}: engine.steps[{i}] is not a list of [position, token] pairs")
    for i, call in enumerate(engine["logits_calls"]):
        if not (isinstance(call, list) and len(call) == 2 and all(map(_integer, call)) and 0 <= call[0] < len(steps) and call[1] >= 1):
            raise PrecisionError(f"dump {dump.source}: engine.logits_calls[{i}] = {call!r} is not [a step, rows]"[:200])
    records = dump.logprob_records()
    if len(records) != len(dump.sequences):
        raise PrecisionError(f"dump {dump.source}: {len(records)} log-prob records for {len(dump.sequences)} sequences; one each")
    for i, (sequence, record) in enumerate(zip(dump.sequences, records, strict=True)):
        if record.path != f"seq[{i}]" or record.tensor is None or tuple(record.tensor.shape) != (len(sequence.tokens) - 1,):
            shape = tuple(record.tensor.shape) if record.tensor is not None else None
            raise PrecisionError(
                f"dump {dump.source}: log-prob record {record.path} holds {shape} values; sequence {i} has {len(sequence.tokens)} tokens, "
                f"so {len(sequence.tokens) - 1} (every token but the first)"
            )
    fed = steps_of(dump.sequences, [[(int(p), int(t)) for p, t in rows] for rows in steps])
    for i, found in enumerate(fed):
        missing = next((r for r, step in enumerate(found[:-1]) if step is None), None)
        if missing is not None:
            raise PrecisionError(
                f"dump {dump.source}: sequences[{i}] token {missing} ({dump.sequences[i].tokens[missing]}) at position {missing} is in no "
                "step the engine ran (engine.steps): the sequences are not the ones the engine fed"
            )


def _load_tensor(root: Path, record: Record) -> torch.Tensor:
    name = record.file
    where = f"record {record.fqn or '<root>'} {record.io} {record.path}"
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise PrecisionError(f"dump {root}: {where} names {name!r}, not a file inside the dump; the manifest is damaged or crafted")
    file = root / name
    if not file.resolve().is_relative_to(root.resolve()):
        raise PrecisionError(f"dump {root}: {where} names {name!r}, which leads outside the dump; refused")
    if not file.exists():
        raise PrecisionError(f"dump {root}: tensor file {file} is gone ({where})")
    try:
        tensor = torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise PrecisionError(
            f"dump {root}: {file} is refused by weights_only loading (it carries code or other objects: "
            f"{first_line(exc, 'unpickling failed', 200)})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        why = first_line(exc, type(exc).__name__, 200)
        raise PrecisionError(f"dump {root}: {file} is not a readable tensor file (truncated or damaged: {why})") from None
    if not isinstance(tensor, torch.Tensor):
        raise PrecisionError(f"dump {root}: {file} holds a {type(tensor).__name__}, not a tensor ({where})")
    if tuple(tensor.shape) != record.shape or dtype_name(tensor.dtype) != record.dtype:
        got = f"{dtype_name(tensor.dtype)} {tuple(tensor.shape)}"
        raise PrecisionError(f"dump {root}: {file} holds {got} but the manifest says {record.dtype} {record.shape}; the dump is damaged")
    return tensor


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------


def _detach(value: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


_RECORDING: dict[int, DumpRecorder] = {}  # id(model) -> its recorder, while one is entered
_RECORDING_LOCK = threading.Lock()


class DumpRecorder:
    """Forward hooks recording every module call (see the module docstring); removed on exit.

    ``out``: a directory to write on exit (None: keep the ``Dump`` in memory, ``rec.dump``);
    ``overwrite``: replace a dump already there. ``inputs``: record every call's input tensors too.
    ``replay``: keep each call's live arguments (tensors cloned) so the comparator can run a module
    again alone. One recorder per model at a time, entered once.
    """

    def __init__(
        self,
        model: nn.Module,
        out: str | os.PathLike[str] | None = None,
        *,
        inputs: bool = False,
        replay: bool = False,
        overwrite: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise PrecisionError(f"DumpRecorder records an nn.Module, got {type(model).__name__}")
        if out is not None and not isinstance(out, (str, os.PathLike)):
            raise PrecisionError(f"DumpRecorder(out={out!r}): a directory path, or None to keep the dump in memory")
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if out is not None:  # before anything runs: where this rank's dump will go
            check_out_path(Path(out) / f"rank{rank}" if world > 1 else out, overwrite=overwrite)
        self.model = model
        self.out = out
        self.overwrite = overwrite
        self.dump = Dump(module_class_name(model), inputs=inputs, rank=rank, world_size=world)  # the user's class under FSDP2
        self.replay = replay
        self._handles: list[Any] = []
        self._calls: Counter[str] = Counter()
        self._clock = 0
        self._open: dict[int, list[tuple[str, int, int]]] = {}
        self._entered = False

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
        if self._entered:
            raise PrecisionError("this DumpRecorder was entered already; one recorder records one forward: make a new one")
        with _RECORDING_LOCK:
            if id(self.model) in _RECORDING:
                raise PrecisionError(
                    f"{type(self.model).__name__} is being recorded by another DumpRecorder (another thread or an outer "
                    "`with`); two recorders on one model would cross their records. Record one forward at a time"
                )
            _RECORDING[id(self.model)] = self
        self._entered = True
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
            self.dump.save(self.out, overwrite=self.overwrite)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with _RECORDING_LOCK:
            if _RECORDING.get(id(self.model)) is self:
                del _RECORDING[id(self.model)]


def dump(
    model: nn.Module, *args: Any, out: str | os.PathLike[str] | None = None, inputs: bool = False, overwrite: bool = False, **kwargs: Any
) -> Dump:
    """Run ``model(*args, **kwargs)`` once (under whatever autocast is active) and record it."""
    with torch.no_grad(), DumpRecorder(model, out, inputs=inputs, overwrite=overwrite) as recorder:
        model(*args, **kwargs)
    return recorder.dump


make_callable(__name__, dump)  # fxp.dump(...) calls the function; import fx_precision.dump binds this module
