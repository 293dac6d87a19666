"""Models by name for the command line, tests and benchmarks (random init, no download).

qwen3_5-tiny       Qwen3_5ForCausalLM, 4 layers (linear, full, linear, full), hidden 48
qwen3_5-tiny-tied  the same with tie_word_embeddings=True (as small Qwen3 / Qwen3.5 checkpoints ship)
qwen3_5-4b-slice   Qwen3.5-4B layer dimensions, 2 layers (one linear-, one full-attention)
qwen3_5-4b         Qwen3.5-4B text dimensions, 32 layers (for meta-device lint)
toy-decoder        the hand-written ToyDecoder (needs no transformers)
pkg.module:factory any zero-argument callable returning an nn.Module
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fx_precision.errors import PrecisionError
from fx_precision.hf import require_transformers
from fx_precision.tools.toy_decoder import ToyDecoder
from fx_precision.training_side import plain_forward_kwargs


def qwen3_5_config(name: str) -> Any:
    """The ``Qwen3_5TextConfig`` of a built-in Qwen3.5 name.

    The 4B dimensions are Qwen3.5-4B's text tower (hidden 2560, 32 layers, 16 query / 4 KV heads of
    256, linear attention 16 key / 32 value heads of 128, every 4th layer full attention); the
    embedding is left untied so that an embedding gather rule does not also select ``lm_head``.
    """
    transformers = require_transformers()
    tied = name.endswith("-tied")
    name = name.removesuffix("-tied")
    if name == "qwen3_5-tiny":
        kwargs: dict[str, Any] = dict(
            vocab_size=256,
            hidden_size=48,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=2,
            max_position_embeddings=256,
        )
    else:
        kwargs = dict(
            vocab_size=248320,
            hidden_size=2560,
            intermediate_size=9216,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            full_attention_interval=4,
            max_position_embeddings=32768,
        )
        if name == "qwen3_5-4b-slice":
            kwargs.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return transformers.Qwen3_5TextConfig(tie_word_embeddings=tied, **kwargs)


def _qwen3_5(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = require_transformers()
        return transformers.Qwen3_5ForCausalLM(qwen3_5_config(name))

    return build


BUILTIN: dict[str, Callable[[], nn.Module]] = {
    "qwen3_5-tiny": _qwen3_5("qwen3_5-tiny"),
    "qwen3_5-tiny-tied": _qwen3_5("qwen3_5-tiny-tied"),
    "qwen3_5-4b-slice": _qwen3_5("qwen3_5-4b-slice"),
    "qwen3_5-4b": _qwen3_5("qwen3_5-4b"),
    "toy-decoder": ToyDecoder,
}


MODEL_HELP = (
    "a built-in name (qwen3_5-tiny, qwen3_5-tiny-tied, qwen3_5-4b-slice, qwen3_5-4b, toy-decoder), package.module:factory "
    "(a callable with no arguments returning an nn.Module), or a directory or config.json of a transformers checkpoint "
    "(built from its config with random weights; on the meta device for plan and lint)"
)


def config_path(name: str) -> Path | None:
    """The ``config.json`` that ``name`` points at (a checkpoint directory or the file), if any."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file() and path.suffix == ".json":
        return path
    return None


def is_checkpoint_path(name: str) -> bool:
    """A filesystem path (a directory or a .json file), as opposed to a built-in name or a factory."""
    return name not in BUILTIN and (os.sep in name or name.endswith(".json") or Path(name).expanduser().exists())


def model_note(name: str, dtype: torch.dtype | None) -> str | None:
    """For a checkpoint path: which dtype its config stores and which the model is built at."""
    if not is_checkpoint_path(name):
        return None
    from fx_precision.checkpoints import read_checkpoint_config

    return read_checkpoint_config(name).describe(dtype)


def _factory(name: str, dtype: torch.dtype | None) -> Callable[[], nn.Module]:
    if name in BUILTIN:
        return BUILTIN[name]
    if is_checkpoint_path(name):
        from fx_precision.checkpoints import build_from_config, read_checkpoint_config

        cc = read_checkpoint_config(name)  # checked here: a bad config is refused before anything is built
        return lambda: build_from_config(cc, dtype=dtype)
    if ":" not in name:
        raise PrecisionError(f"--model {name!r}: unknown model; {MODEL_HELP}")
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or not all(part.isidentifier() for part in [*module_name.split("."), attr]):
        raise PrecisionError(f"--model {name!r}: expected package.module:factory (two dotted Python names around one ':')")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the console script's sys.path lacks the working directory
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PrecisionError(f"--model {name!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    if not callable(factory):
        raise PrecisionError(f"--model {name!r}: {attr!r} is a {type(factory).__name__}, not a callable returning an nn.Module")
    return factory


def build_model(
    name: str, *, seed: int = 0, device: str | torch.device | None = None, dtype: torch.dtype | None = torch.float32
) -> nn.Module:
    """Build a model by built-in name, ``package.module:factory`` or config path; ``device="meta"`` allocates nothing.

    ``dtype``: what a checkpoint config is built at, the run's master dtype (None: what the file stores);
    built-in names and factories build what they build.
    """
    factory = _factory(name, dtype)
    torch.manual_seed(seed)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = factory()
    except PrecisionError:
        raise
    except Exception as exc:  # the user's factory: any failure is theirs to see, as one line
        raise PrecisionError(
            f"--model {name!r}: building the model raised {type(exc).__name__}: {exc}. "
            "A factory takes no arguments and returns an nn.Module"
        ) from exc
    if not isinstance(model, nn.Module):
        raise PrecisionError(f"--model {name!r}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None) or getattr(model, "vocab_size", None)
    if size is None:
        raise PrecisionError(
            f"{type(model).__name__} has no vocab_size (model.config.vocab_size or model.vocab_size); "
            "the command line drives models with token ids"
        )
    return int(size)


def token_batch(model: nn.Module, *, batch: int = 2, seq_len: int = 16, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """Synthetic token ids from a fixed seed; the sequence fits the model's positions."""
    if batch < 1 or seq_len < 1:
        raise PrecisionError(f"--batch {batch} --seq-len {seq_len}: both must be at least 1")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise PrecisionError(f"--seq-len {seq_len}: {type(model).__name__} has max_position_embeddings={limit}; use at most that")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size(model), (batch, seq_len), generator=gen).to(device)


forward_kwargs = plain_forward_kwargs  # the training side's: ``use_cache=False`` for transformers models
