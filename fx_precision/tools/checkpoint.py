"""Checkpoint directories as a training run loads them: read, check, build, load, write.

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
    └── write_tiny_checkpoint(arch, out)                   a seeded random bf16 checkpoint (safetensors +
                                                            config.json) for both sides of a comparison

A training run holds fp32 masters (or what ``--master`` says) and FSDP2 gathers them; a config's
``torch_dtype: bfloat16`` names the file's storage, not what the run analyses. Nothing from a
checkpoint directory is executed: ``auto_map`` (``trust_remote_code``) is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fx_precision.dtypes import dtype_name, parse_dtype
from fx_precision.errors import PrecisionError
from fx_precision.tools.hf import require_transformers

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
    transformers = require_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), config=cc.config, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PrecisionError(f"--model {directory}: loading the weights failed ({first[:300]})") from None
    return model.eval()


ENGINE_DIMS: dict[str, Any] = dict(  # tiny, and every head dim one the engine's CPU attention runs (32)
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    initializer_range=0.05,
)


def weights_fingerprint(path: str | os.PathLike[str], sample: int = 1 << 20) -> str:
    """A short digest that tells two checkpoints' weights apart without reading all of them: each
    safetensors file's name, size, header (tensor names, dtypes, shapes, offsets) and its first and
    last ``sample`` bytes. The engine dump records it; the training side checks its checkpoint against it."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(config_file(path).parent.glob("*.safetensors"))
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(min(size, sample)))
            if size > 2 * sample:
                handle.seek(size - sample)
                digest.update(handle.read(sample))
    return digest.hexdigest()[:16] if files else "no-safetensors"


def write_tiny_checkpoint(
    arch_name: str, out: str | os.PathLike[str], *, seed: int = 0, overwrite: bool = False, dims: dict[str, Any] | None = None
) -> Path:
    """A seeded random checkpoint of an arch-zoo architecture at engine-compatible sizes (``dims`` over
    ENGINE_DIMS): bf16 safetensors and config.json (``"torch_dtype": "bfloat16"``), as a published
    checkpoint is stored."""
    from fx_precision.tools.arch_zoo import arch

    spec = arch(arch_name)
    target = _checked_out(out, overwrite)
    model = spec.build(seed=seed, dims={**ENGINE_DIMS, **(dims or {})}).to(torch.bfloat16)
    return _save(model, target)


MAX_SHAPED_POSITIONS = 4096  # the engine's KV cache is sized for the positions a config names: a published 128k is cut


def write_shaped_checkpoint(config: str | os.PathLike[str], out: str | os.PathLike[str], *, layers: int, seed: int = 0,
                            overwrite: bool = False) -> Path:  # fmt: skip
    """A published model's shape with random weights: every dimension of ``config`` (a config.json: heads, KV heads,
    head_dim, intermediate, vocabulary, rope scaling, tied embeddings, biases) but ``layers`` decoder layers and at
    most ``MAX_SHAPED_POSITIONS`` positions; weights drawn as the architecture initialises them (std
    ``initializer_range``) from ``seed``, norm weights 1 + N(0, 0.05) and biases N(0, initializer_range) (a norm
    of ones and a zero bias would test nothing of their arithmetic), stored bf16 as published checkpoints are."""
    cc = read_checkpoint_config(config)
    if not 1 <= layers <= int(getattr(cc.config, "num_hidden_layers", layers) or layers):
        raise PrecisionError(f"--layers {layers}: between 1 and the config's {cc.config.num_hidden_layers} layers")
    target = _checked_out(out, overwrite)
    shaped = cc.config
    shaped.num_hidden_layers = layers
    if isinstance(getattr(shaped, "layer_types", None), list):
        shaped.layer_types = shaped.layer_types[:layers]
    positions = getattr(shaped, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > MAX_SHAPED_POSITIONS:
        shaped.max_position_embeddings = MAX_SHAPED_POSITIONS
    transformers = require_transformers()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(shaped, dtype=torch.float32)
    with torch.no_grad():  # norms initialise to 1 and biases to 0, which tests nothing of their arithmetic: perturbed
        for name, param in model.named_parameters():
            if param.dim() == 1 and name.endswith("bias"):
                param.normal_(0.0, float(getattr(shaped, "initializer_range", 0.02)))
            elif param.dim() == 1 and bool((param == 1).all()):
                param.add_(torch.randn_like(param) * 0.05)
    return _save(model.to(torch.bfloat16), target)


def _checked_out(out: str | os.PathLike[str], overwrite: bool) -> Path:
    target = Path(out).expanduser().resolve()  # resolved: "." has a real parent, where the staging sibling goes
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        if not (overwrite and (target / "config.json").is_file()):
            raise PrecisionError(f"--out {target}: exists and is not empty; pass --overwrite to replace a checkpoint, or pick another path")
    return target


def _save(model: nn.Module, target: Path) -> Path:
    """``model`` as bf16 safetensors + config.json at ``target``, written beside it and renamed into place."""
    staging = target.parent / f".{target.name}.writing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        config = json.loads((staging / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"  # as published checkpoints name their storage
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
