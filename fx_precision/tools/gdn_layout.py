"""A Qwen3.5-MoE checkpoint laid out as Qwen3-Next's: the same weights, for an engine that runs only the latter.

vLLM builds Qwen3.5's decoder layer on Qwen3-Next's (one ``QwenGatedDeltaNetAttention`` for both). Where it cannot
import Qwen3.5 (its module imports the Qwen3-VL processor, which needs torchvision's CPU build), it runs the same
weights as Qwen3-Next, and the contract read off that engine is the one Qwen3.5's training side follows::

    Qwen3.5-MoE (text)                         Qwen3-Next
    linear_attn.in_proj_qkv  [q | k | v]  ┐
    linear_attn.in_proj_z    [z]          ┘ ->  linear_attn.in_proj_qkvz: per key head g, [q_g | k_g | v_g | z_g]
    linear_attn.in_proj_b, in_proj_a        ->  linear_attn.in_proj_ba:   per key head g, [b_g | a_g]
    every other tensor                      ->  as stored (the conv runs over [q | k | v] in both)
    config                                  ->  model_type qwen3_next; every layer's MLP sparse (decoder_sparse_step 1,
                                                no mlp_only_layers); top-k weights renormalised (Qwen3.5-MoE always
                                                does); one rotary stream (text positions: mrope's sections coincide)

    relaid_tensors(tensors, config)     the tensor mapping, name -> tensor
    qwen3_next_config(config)           the config mapping
    write_qwen3_next_layout(src, out)   a checkpoint directory written beside ``out`` and renamed into place
    relaid_digest(checkpoint)           the weights digest of its Qwen3-Next layout (None: not a Qwen3.5-MoE text
                                        checkpoint): how the training side knows an engine dump of that layout is of
                                        these weights

A dense Qwen3.5 has no counterpart (vLLM's Qwen3-Next needs an MoE layer) and a vision-language checkpoint's text
weights live under another prefix: both refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fx_precision.errors import PrecisionError
from fx_precision.out_dirs import check_out_dir, replace_dir, staging_path

SOURCE_TYPE, TARGET_TYPE = "qwen3_5_moe_text", "qwen3_next"
_ROPE_DROPPED = ("mrope_section", "mrope_interleaved")


def qwen3_next_config(config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3-Next config of a Qwen3.5-MoE text config (module docstring)."""
    kind = config.get("model_type")
    if kind != SOURCE_TYPE:
        hint = " (a dense Qwen3.5: vLLM's Qwen3-Next needs MoE layers)" if kind == "qwen3_5_text" else ""
        hint = hint or (" (a vision-language checkpoint: write its text model alone)" if "text_config" in config else "")
        raise PrecisionError(f"the Qwen3-Next layout takes a Qwen3.5-MoE text checkpoint (model_type {SOURCE_TYPE}), got {kind!r}{hint}")
    out = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map")}
    rope = out.get("rope_parameters")
    if isinstance(rope, dict):
        out["rope_parameters"] = {k: v for k, v in rope.items() if k not in _ROPE_DROPPED}
    out.update(architectures=["Qwen3NextForCausalLM"], model_type=TARGET_TYPE, decoder_sparse_step=1, mlp_only_layers=[],
               norm_topk_prob=True)  # fmt: skip
    return out


def relaid_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The Qwen3-Next tensors of a Qwen3.5-MoE checkpoint's (module docstring); every value the same bits."""
    heads, value_heads = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    if value_heads % heads:
        raise PrecisionError(
            f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {heads}: no Qwen3-Next layout"
        )
    per = value_heads // heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition("linear_attn.")
        if not prefix or leaf not in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
            out[name] = tensor
            continue
        if leaf == "in_proj_qkv.weight":
            z = tensors[f"{prefix}linear_attn.in_proj_z.weight"]
            hidden = tensor.shape[1]
            q, k, v = tensor.split([heads * dk, heads * dk, value_heads * dv])
            parts = (q.view(heads, dk, hidden), k.view(heads, dk, hidden), v.view(heads, per * dv, hidden), z.view(heads, per * dv, hidden))
            out[f"{prefix}linear_attn.in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, hidden).contiguous()
        elif leaf == "in_proj_b.weight":
            a = tensors[f"{prefix}linear_attn.in_proj_a.weight"]
            hidden = tensor.shape[1]
            both = (tensor.view(heads, per, hidden), a.view(heads, per, hidden))
            out[f"{prefix}linear_attn.in_proj_ba.weight"] = torch.cat(both, dim=1).reshape(-1, hidden).contiguous()
    return out


def write_qwen3_next_layout(src: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """``src`` (a Qwen3.5-MoE text checkpoint directory) as a Qwen3-Next checkpoint at ``out``: one safetensors file
    and its config; nothing is written where the source is refused."""
    from safetensors.torch import save_file

    from fx_precision.tools.checkpoint import is_checkpoint_dir

    source = Path(src).expanduser().resolve()
    if not (source / "config.json").is_file():
        raise PrecisionError(f"{src}: no config.json (a Qwen3.5-MoE checkpoint directory)")
    config = json.loads((source / "config.json").read_text())
    relaid_config = qwen3_next_config(config)
    target = (
        check_out_dir(out, kind="checkpoint", overwrite=overwrite, replaceable=is_checkpoint_dir, sources=(src,)).expanduser().resolve()
    )
    relaid = relaid_tensors(_load(source), config)
    staging = staging_path(target)
    try:
        staging.mkdir(parents=True)
        save_file(relaid, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(relaid_config, indent=2))
        if (source / "generation_config.json").is_file():
            shutil.copy(source / "generation_config.json", staging / "generation_config.json")
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _load(source: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if not tensors:
        raise PrecisionError(f"{source}: no safetensors files")
    return tensors


def relaid_digest(checkpoint: str | os.PathLike[str]) -> str | None:
    """``weights_digest`` of ``checkpoint`` laid out as Qwen3-Next (module docstring), or None where it is not a
    Qwen3.5-MoE text checkpoint."""
    from fx_precision.checkpoints import tensors_digest

    source = Path(checkpoint).expanduser()
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("model_type") != SOURCE_TYPE:
        return None
    return tensors_digest(relaid_tensors(_load(source), config).items())


RELAID_ARCHITECTURE = "Qwen3NextForCausalLM"


__all__ = ["RELAID_ARCHITECTURE", "qwen3_next_config", "relaid_digest", "relaid_tensors", "write_qwen3_next_layout"]
