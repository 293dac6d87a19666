"""Checkpoint directories as a training run loads them: read, check, build, load, and know their weights.

    CKPT/config.json ── read_checkpoint_config ──▶ CheckpointConfig
    │                   ├── refuses: model code from the directory (auto_map of a model type
    │                   │            transformers does not know), quantization_config, no config.json,
    │                   │            non-positive sizes, absurd layer counts       (one PrecisionError each)
    │                   ├── stored: "torch_dtype" / "dtype" (top level or text_config), e.g. bf16
    │                   └── config: the causal LM's config (a multimodal checkpoint: its text_config)
    │
    ├── build_from_config(cc, dtype=fp32, device="meta")   random weights at the *master* dtype,
    │                                                       whatever the file stores (lint, plan, census)
    ├── load_checkpoint(dir, dtype=fp32)                   the real weights, bf16 -> fp32 exactly
    ├── check_weights_fit_config(cc)                      the stored tensors at the shapes the config builds
    └── weights_digest(dir) / tensors_digest(named)        the identity of every byte of every tensor: what an
                                                            engine loaded, checked against what a trainer loads

A training run holds fp32 masters (or what ``--master`` says) and FSDP2 gathers them; a config's
``torch_dtype: bfloat16`` names the file's storage, not what the run analyses. Nothing from a
checkpoint directory is executed: ``auto_map`` (``trust_remote_code``) is refused. Writing checkpoints
(tiny ones, published shapes) is ``tools/checkpoint.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fx_precision.dtypes import dtype_name, parse_dtype
from fx_precision.errors import PrecisionError, first_line
from fx_precision.hf import require_transformers

MAX_LAYERS = 1024  # more than any published decoder (the deepest have ~160); a typo in a config otherwise never answers
MAX_SIZE = 1 << 24  # per dimension: vocabularies and widths of published models are far below 16M
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "n_embd",
    "n_head",
)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass(frozen=True)
class CheckpointConfig:
    """A checked ``config.json``: the transformers config of the causal LM and what the file stores."""

    file: Path
    config: Any  # transformers.PretrainedConfig of the text model
    stored: torch.dtype | None  # the weights' storage dtype the file names (None: it names none)
    stored_field: str | None  # "torch_dtype" | "dtype" | "text_config.dtype" ...
    remote_code: bool = False  # the config names auto_map; ignored, since transformers knows the model type

    def describe(self, built: torch.dtype | None) -> str:
        stored = f"{dtype_name(self.stored)} ({self.stored_field})" if self.stored else "no dtype field"
        text = f"{self.file}: stores {stored}; built at {dtype_name(built or self.stored or torch.float32)}"
        return text + ("; auto_map ignored (the built-in class is used, no checkpoint code runs)" if self.remote_code else "")


def config_file(path: str | os.PathLike[str]) -> Path:
    """The ``config.json`` a checkpoint path names (the directory or the file itself)."""
    file = Path(path).expanduser()
    if file.is_dir():
        if not (file / "config.json").is_file():
            raise PrecisionError(f"--model {file}: the directory has no config.json; point at a transformers checkpoint directory")
        return file / "config.json"
    if not file.is_file():
        raise PrecisionError(f"--model {file}: no such file or directory")
    return file


def _stored_dtype(raw: dict[str, Any]) -> tuple[torch.dtype | None, str | None]:
    for where, table in (("", raw), ("text_config.", raw.get("text_config") or {})):
        for key in ("dtype", "torch_dtype"):
            value = table.get(key) if isinstance(table, dict) else None
            if isinstance(value, str) and value not in ("auto", ""):
                try:
                    return parse_dtype(value, what=f"config {where}{key}"), f"{where}{key}"
                except PrecisionError:
                    continue  # fp8 and friends: the quantisation check speaks about those
    return None, None


def _check_sizes(raw: dict[str, Any], file: Path) -> None:
    tables = [("", raw)] + ([("text_config.", raw["text_config"])] if isinstance(raw.get("text_config"), dict) else [])
    for where, table in tables:
        for key in (*SIZE_FIELDS, *LAYER_FIELDS):
            value = table.get(key)
            if value is None or isinstance(value, bool):
                continue
            if not isinstance(value, int) or value < 1:
                raise PrecisionError(f"--model {file}: {where}{key} = {value!r}; it must be a positive integer")
            limit = MAX_LAYERS if key in LAYER_FIELDS else MAX_SIZE
            if value > limit:
                raise PrecisionError(
                    f"--model {file}: {where}{key} = {value} is over the limit of {limit}; "
                    "no published decoder is that large, check the config"
                )


def read_checkpoint_config(path: str | os.PathLike[str]) -> CheckpointConfig:
    """Read and check a checkpoint's config (see the module docstring); builds nothing."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PrecisionError(f"--model {file}: not a readable JSON config ({exc})") from None
    if not isinstance(raw, dict):
        raise PrecisionError(f"--model {file}: a config is a JSON object, this file holds a {type(raw).__name__}")
    remote = "auto_map" in raw or any(isinstance(v, dict) and "auto_map" in v for v in raw.values())
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise PrecisionError(
            f"--model {file}: a quantised checkpoint (quantization_config, quant_method={method!r}); fx_precision plans "
            "fp32 / bf16 / fp16 weights. Point at the unquantised checkpoint"
        )
    if not isinstance(raw.get("model_type"), str):
        raise PrecisionError(f"--model {file}: the config has no model_type; transformers needs it to pick the architecture")
    _check_sizes(raw, file)
    stored, stored_field = _stored_dtype(raw)
    transformers = require_transformers()
    if raw["model_type"] not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        code = "its auto_map names model code shipped in the checkpoint directory, which" if remote else "only code outside transformers"
        raise PrecisionError(
            f"--model {file}: model_type {raw['model_type']!r} is unknown to transformers {transformers.__version__}; {code} could "
            "build it, and fx_precision runs no code from a checkpoint. Upgrade transformers, or build the model in code "
            "(--model pkg.mod:factory)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(file.parent) if file.name == "config.json" else str(file))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrecisionError(
            f"--model {file}: transformers cannot read this config ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
            "check its model_type, and that this transformers version knows it"
        ) from None
    text = getattr(config, "text_config", None)
    return CheckpointConfig(file, text if text is not None else config, stored, stored_field, remote)  # multimodal: its text tower


def build_from_config(cc: CheckpointConfig, *, dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """The causal LM of ``cc`` with random weights at ``dtype`` (None: the stored dtype, else fp32),
    on the ambient device (``with torch.device("meta")`` allocates nothing)."""
    transformers = require_transformers()
    target = dtype or cc.stored or torch.float32
    try:
        model = transformers.AutoModelForCausalLM.from_config(cc.config, dtype=target)
    except ValueError as exc:
        raise PrecisionError(f"--model {cc.file}: model_type {cc.config.model_type!r} has no causal-LM class here ({exc})") from None
    wrong = {p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != target}
    if wrong:  # a model class that ignores the dtype argument: convert, as loading into masters does
        model = model.to(target)
    return model


def load_checkpoint(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint's real weights at ``dtype`` (fp32 masters hold bf16 values exactly)."""
    cc = read_checkpoint_config(path)
    directory = cc.file.parent
    if not any(directory.glob("*.safetensors")) and not any(directory.glob("*.bin")):
        raise PrecisionError(f"--model {directory}: no weight files (*.safetensors); write one with fx-precision checkpoint")
    if any(directory.glob("*.safetensors")):
        check_weights_fit_config(cc)
    transformers = require_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), config=cc.config, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        raise PrecisionError(f"--model {directory}: loading the weights failed ({first_line(exc, type(exc).__name__, 300)})") from None
    return model.eval()


DIGEST_CHUNK = 16 << 20  # bytes read at a time: the hash streams, whatever a file's size


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, as its header states it: where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    length: int


def stored_tensors(path: str | os.PathLike[str]) -> list[StoredTensor]:
    """Every tensor of a checkpoint's ``*.safetensors`` files (read from their headers; no data read), in name order."""
    files = sorted(config_file(path).parent.glob("*.safetensors"))
    if not files:
        raise PrecisionError(f"{path}: no *.safetensors files; write the checkpoint as safetensors (fx-precision checkpoint does)")
    entries: list[StoredTensor] = []
    for file in files:
        with file.open("rb") as handle:
            head = handle.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= 100 << 20:
                raise PrecisionError(f"{file}: not a safetensors file (a header of {size} bytes)")
            try:
                header = json.loads(handle.read(size))
                for name, info in header.items():
                    if name != "__metadata__":
                        begin, end = (int(x) for x in info["data_offsets"])
                        shape = tuple(int(d) for d in info["shape"])
                        entries.append(StoredTensor(name, str(info["dtype"]), shape, file, 8 + size + begin, end - begin))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise PrecisionError(f"{file}: an unreadable safetensors header ({type(exc).__name__}: {exc})") from None
    return sorted(entries, key=lambda e: (e.name, str(e.file)))


def weights_digest(path: str | os.PathLike[str]) -> str:
    """The identity of a checkpoint's weights: sha256 over every safetensors file's tensors, each by name, dtype,
    shape and every byte of its data, in name order (the files' headers and layout do not enter: the same tensors
    in other shards are the same weights). Streamed: a multi-GB shard is read once, at disk speed."""
    digest = hashlib.sha256()
    for t in stored_tensors(path):
        digest.update(f"{t.name}|{t.dtype}|{list(t.shape)}|{t.length}\n".encode())
        with t.file.open("rb") as handle:
            handle.seek(t.offset)
            left = t.length
            while left > 0:
                chunk = handle.read(min(DIGEST_CHUNK, left))
                if not chunk:
                    raise PrecisionError(f"{t.file}: tensor {t.name} ends past the file (truncated checkpoint)")
                digest.update(chunk)
                left -= len(chunk)
    return f"sha256:{digest.hexdigest()}"


FLOAT_STORED = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def non_finite_tensors(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """(name, NaN or Inf values, values) of every floating tensor of a checkpoint holding any, streamed a tensor at a
    time (a checkpoint that cannot be trained on or sampled from, caught before an engine or a rank starts)."""
    found = []
    for t in stored_tensors(path):
        dtype = FLOAT_STORED.get(t.dtype)
        if dtype is None or t.length == 0:
            continue
        with t.file.open("rb") as handle:
            handle.seek(t.offset)
            data = handle.read(t.length)
        values = torch.frombuffer(bytearray(data), dtype=dtype)
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            found.append((t.name, bad, int(values.numel())))
    return found


def check_weights_fit_config(cc: CheckpointConfig) -> None:
    """The weights are the config's: every stored tensor that names a parameter of the model the config builds has that
    parameter's shape (a config whose vocabulary or widths are not the weights' is one line naming the tensor, before
    anything loads them). Names the model renames on load (fused experts) are not held to a shape here."""
    stored = {t.name: t.shape for t in stored_tensors(cc.file.parent)}
    with torch.device("meta"):
        model = build_from_config(cc, dtype=torch.bfloat16)
    for name, param in model.named_parameters(remove_duplicate=False):
        want = tuple(param.shape)
        if name in stored and stored[name] != want:
            raise PrecisionError(
                f"--model {cc.file.parent}: {name} is {list(stored[name])} in the weights, {list(want)} by the config "
                f"(vocab_size {getattr(cc.config, 'vocab_size', '?')}, hidden_size {getattr(cc.config, 'hidden_size', '?')}): "
                "the config is not the weights'; use the config.json that came with them"
            )


_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32"}


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``weights_digest`` of tensors in memory (what a checkpoint of them would digest to): the identity of the
    weights a trainer syncs to an engine without writing them."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        data = tensor.detach().contiguous().cpu()
        raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
        digest.update(f"{name}|{_SAFETENSORS_DTYPE.get(data.dtype, str(data.dtype))}|{list(data.shape)}|{raw.numel()}\n".encode())
        digest.update(raw.numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"
