"""Writing checkpoints for both sides of a comparison: a tiny one of an arch-zoo architecture, or a published shape.

    write_tiny_checkpoint(arch, out)                  hidden 128, 3 layers, head_dim 32 (sizes the engine's CPU
                                                      attention runs), seeded random weights
    write_shaped_checkpoint(config, out, layers=N)    every dimension of a published config, N layers

Both store bf16 safetensors and a config.json naming its dtype, as published checkpoints are, written beside
``out`` and renamed into place (never into the directory they replace).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fx_precision.checkpoints import read_checkpoint_config
from fx_precision.errors import PrecisionError
from fx_precision.hf import require_transformers
from fx_precision.out_dirs import check_out_dir, replace_dir, staging_path

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


def write_tiny_checkpoint(
    arch_name: str, out: str | os.PathLike[str], *, seed: int = 0, overwrite: bool = False, dims: dict[str, Any] | None = None
) -> Path:
    """A seeded random checkpoint of an arch-zoo architecture at engine-compatible sizes (``dims`` over
    ENGINE_DIMS): bf16 safetensors and config.json (``"torch_dtype": "bfloat16"``), as a published
    checkpoint is stored."""
    from fx_precision.tools.arch_zoo import arch

    spec = arch(arch_name)
    target = _checked_out(out, overwrite, ())
    model = spec.build(seed=seed, dims={**ENGINE_DIMS, **(dims or {})}).to(torch.bfloat16)
    return _save(model, target)


MAX_SHAPED_POSITIONS = 8192  # the engine's KV cache is sized for the positions a config names: a published 128k is cut


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # how MoE configs name their expert count
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "top_k")


def write_shaped_checkpoint(config: str | os.PathLike[str], out: str | os.PathLike[str], *, layers: int, seed: int = 0,
                            overwrite: bool = False, experts: int | None = None) -> Path:  # fmt: skip
    """A published model's shape with random weights: every dimension of ``config`` (a config.json: heads, KV heads,
    head_dim, intermediate, vocabulary, rope scaling, tied embeddings, biases) but ``layers`` decoder layers, at
    most ``MAX_SHAPED_POSITIONS`` positions and, where given, ``experts`` experts per MoE layer (each expert and the
    experts per token as published: what a 24 GiB machine holds of a 512-expert model); weights drawn as the
    architecture initialises them (std ``initializer_range``) from ``seed``, norm weights 1 + N(0, 0.05) (zero-centred
    ones N(0, 0.05)) and biases N(0, initializer_range) (a norm of ones and a zero bias would test nothing of their
    arithmetic), stored bf16 as published checkpoints are."""
    target = _checked_out(out, overwrite, (config,))
    cc = read_checkpoint_config(config)
    if not 1 <= layers <= int(getattr(cc.config, "num_hidden_layers", layers) or layers):
        raise PrecisionError(f"--layers {layers}: between 1 and the config's {cc.config.num_hidden_layers} layers")
    shaped = cc.config
    if experts is not None:
        _cut_experts(shaped, experts)
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
            elif param.dim() == 1 and (bool((param == 1).all()) or ("norm" in name and bool((param == 0).all()))):
                param.add_(torch.randn_like(param) * 0.05)
    return _save(model.to(torch.bfloat16), target)


def _cut_experts(config: Any, experts: int) -> None:
    """``config`` with ``experts`` experts per MoE layer, refused where it has none or routes more per token."""
    name = next((n for n in EXPERT_COUNTS if isinstance(getattr(config, n, None), int)), None)
    if name is None:
        raise PrecisionError(f"--experts {experts}: the config names no expert count ({', '.join(EXPERT_COUNTS)}): a dense model")
    per_token = next((int(v) for n in EXPERTS_PER_TOKEN if isinstance(v := getattr(config, n, None), int)), 1)
    published = int(getattr(config, name))
    if not per_token <= experts <= published:
        raise PrecisionError(f"--experts {experts}: between the experts per token ({per_token}) and the config's {published}")
    setattr(config, name, experts)


def check_expert_cut(config: str | os.PathLike[str], experts: int) -> None:
    """``--experts`` against the config.json at ``config`` (what write_shaped_checkpoint would refuse), before a run
    builds anything."""
    _cut_experts(read_checkpoint_config(config).config, experts)


def is_checkpoint_dir(root: Path) -> bool:
    return (root / "config.json").is_file()


def _checked_out(out: str | os.PathLike[str], overwrite: bool, sources: tuple[str | os.PathLike[str], ...]) -> Path:
    """The resolved target (``out_dirs.check_out_dir``: never a directory holding anything but a checkpoint, never
    the input config's directory or the working directory), before anything is built."""
    return check_out_dir(out, kind="checkpoint", overwrite=overwrite, replaceable=is_checkpoint_dir, sources=sources).expanduser().resolve()


def _save(model: Any, target: Path) -> Path:
    """``model`` as bf16 safetensors + config.json at ``target``, written beside it and renamed into place."""
    staging = staging_path(target)
    try:
        model.save_pretrained(str(staging), safe_serialization=True)
        config = json.loads((staging / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"  # as published checkpoints name their storage
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
