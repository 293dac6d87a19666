"""The SGLang adapter, read-only: the files SGLang's own dumper writes, as a dump under transformers names.

SGLang's ``debug_utils/dumper.py`` (0.5.x) writes one file per dumped value, ``step=S___rank=R___dump_index=I___
name=N[___TAG=V...].pt``, holding ``{"value": tensor, "meta": {step, rank, dump_index, name, ..., world_size,
tokenizer_path}}``. Its non-intrusive hooks name a module's values ``non_intrusive__<module>.inputs.<i | kwarg>``
and ``non_intrusive__<module>.output[.<i>]``, and the forward batch's fields by their own name (``input_ids``,
``positions``). Read here::

    one step            one call of every module (call i = step i: a sequence prefilled alone, as a teacher-forced
                        training forward sees it); tensors [tokens, ...] become [1, tokens, ...]
    input_ids           the root's token ids (kwargs.input_ids), and the dump's sequence
    SGLang's modules    renamed as fx_precision.engines.vllm.modules renames vLLM's (the two share their layout):
                        qkv_proj -> q_proj, k_proj, v_proj (split by the model's head counts, from the config at
                        ``tokenizer_path`` or the one given); gate_up_proj -> gate_proj, up_proj; a layer's
                        (hidden, residual) -> their bf16 sum; a fused norm's (x, residual) input -> their sum

A tensor-parallel dump (world_size > 1) is refused: its shards would have to be joined first. Files are loaded
with ``weights_only`` (no code runs).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fx_precision.dtypes import dtype_name
from fx_precision.dump import CallInfo, Dump, Record, Sequence
from fx_precision.errors import PrecisionError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FILE = re.compile(r"^step=(?P<step>-?\d+)___rank=(?P<rank>\d+)___dump_index=(?P<index>\d+)___name=(?P<name>[^/]+?)(?:___.+)?\.pt$")
PREFIX = "non_intrusive__"
_LAYER = re.compile(r"^model\.layers\.\d+$")


def _files(path: Path) -> list[Path]:
    found = sorted(p for p in path.glob("*.pt") if FILE.match(p.name))
    if not found:  # the dumper writes under DIR/EXP_NAME/
        found = sorted(p for p in path.glob("*/*.pt") if FILE.match(p.name))
    return found


def _parse(body: str) -> tuple[str, str, str]:
    """``<module>.inputs.<what>`` / ``<module>.output[.<i>]`` (the root's: ``inputs.<what>``, ``output``) as (module,
    "in." + what | "out", "" | ".<i>")."""
    for marker in ("inputs.", "output"):
        if body.startswith(marker):
            module, rest = "", body[len(marker) :]
            break
        if f".{marker}" in body:
            module, _, rest = body.rpartition(f".{marker}")
            break
    else:
        return body, "out", ""
    return (module, "in.", rest) if marker == "inputs." else (module, "out", rest)


def _sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else (x.float() + residual.float()).to(x.dtype)


class SglangDumps:
    name = "sglang"
    live = False  # SGLang's CPU kernels are source-only here: its dumper's files are what is read

    def refuses(self, config: object) -> str | None:
        return "SGLang does not run here; compare reads the files its dumper writes (compare --rollout DIR)"

    def min_prompt_tokens(self, isa: str = "auto") -> int:
        return 1  # it runs no prompt here: nothing to refuse by length

    def recognizes(self, path: str) -> bool:
        directory = Path(path)
        return directory.is_dir() and not (directory / "manifest.json").exists() and bool(_files(directory))

    def start(self, cfg: Any) -> Any:
        raise PrecisionError("sglang is read-only here: its CPU kernels are source-only; compare the files its dumper writes")

    def read_dump(self, path: str, config: PretrainedConfig | None = None) -> Dump:
        """The dumper's files under ``path`` as a dump (module docstring); ``config``: the model's transformers config
        (default: the one at the dump's ``tokenizer_path``), for qkv_proj's split."""
        directory = Path(path)
        files = _files(directory)
        if not files:
            raise PrecisionError(f"{path}: no SGLang dumper files (step=S___rank=R___dump_index=I___name=N.pt)")
        values: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        meta: dict[str, Any] = {}
        for file in files:
            try:
                data = torch.load(str(file), weights_only=True, map_location="cpu")
            except Exception as exc:  # a damaged or code-carrying file: refused, named
                raise PrecisionError(f"{file}: not a dumper file torch.load reads with weights_only ({type(exc).__name__})") from None
            if not isinstance(data, dict) or set(data) != {"value", "meta"} or not isinstance(data["meta"], dict):
                raise PrecisionError(f"{file}: an SGLang dumper file is a {{value, meta}} dict")
            meta = data["meta"]
            if int(meta.get("world_size", 1)) > 1:
                raise PrecisionError(f"{file}: a dump of {meta['world_size']} ranks; join its tensor-parallel shards first (not read here)")
            match = FILE.match(file.name)
            assert match is not None
            if isinstance(data["value"], torch.Tensor):
                values[int(match["step"])][match["name"]] = data["value"]
        config = config if config is not None else _config_at(meta.get("tokenizer_path"))
        dump = Dump(_architecture(config), inputs=True, source=f"sglang dumper files ({path})")
        dump.engine = {"name": "sglang", "files": len(files), "tokenizer_path": meta.get("tokenizer_path")}
        for call, step in enumerate(sorted(values)):
            self._add_step(dump, call, values[step], config)
        return dump

    def _add_step(self, dump: Dump, call: int, named: dict[str, torch.Tensor], config: PretrainedConfig) -> None:
        modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for name, tensor in named.items():
            if name.startswith(PREFIX):
                module, io, part = _parse(name[len(PREFIX) :])
                modules[module][f"{io}{part}"] = tensor
            elif name == "input_ids":  # a core field of the forward batch
                modules[""]["in.input_ids"] = tensor
        order = []
        for module, tensors in modules.items():
            for fqn, io, path, tensor in _rename(module, tensors, config):
                batched = tensor.unsqueeze(0) if tensor.dim() >= 1 and fqn != "" else tensor.reshape(1, -1)
                dump.records.append(Record(fqn, call, io, path, dtype_name(batched.dtype), tuple(batched.shape), batched))
                if fqn not in order:
                    order.append(fqn)
        ids = modules.get("", {}).get("in.input_ids", modules.get("", {}).get("in.0"))
        if ids is not None:
            dump.sequences.append(Sequence(tuple(int(t) for t in ids.flatten().tolist()), int(ids.numel())))
        clock = 0
        for fqn in sorted(order, key=lambda f: -f.count(".")):  # children complete before their parents
            clock += 1
            dump.calls.append(CallInfo(fqn, call, -clock, clock))
        if "" not in order:
            dump.calls.append(CallInfo("", call, -10_000 * (call + 1), 10_000 * (call + 1)))


def _rename(module: str, tensors: dict[str, torch.Tensor], config: PretrainedConfig) -> list[tuple[str, str, str, torch.Tensor]]:
    """One SGLang module's dumped values as transformers' records (fqn, io, path, tensor)."""
    leaf = module.rsplit(".", 1)[-1]
    out = tensors.get("out", tensors.get("out.0"))
    if module == "":  # the forward batch's input_ids (a core field), or the root's first argument
        ids = tensors.get("in.input_ids", tensors.get("in.0"))
        return [("", "in", "kwargs.input_ids", ids.reshape(1, -1))] if ids is not None else []
    if module == "model.embed_tokens" and out is not None:
        return [(module, "out", "out", out)]
    if _LAYER.match(module):  # forward(positions, hidden_states, forward_batch, residual) -> (hidden, residual)
        hidden, residual = tensors.get("in.1", tensors.get("in.hidden_states")), tensors.get("in.3", tensors.get("in.residual"))
        made = [(module, "in", "args[0]", _sum(hidden, residual))] if hidden is not None else []
        if "out.0" in tensors:
            made.append((module, "out", "out", _sum(tensors["out.0"], tensors.get("out.1"))))
        return made
    if leaf.endswith("layernorm") or module == "model.norm":
        x, residual = tensors.get("in.0", tensors.get("in.x")), tensors.get("in.1", tensors.get("in.residual"))
        made = [(module, "in", "args[0]", _sum(x, residual))] if x is not None else []
        return made + ([(module, "out", "out", out)] if out is not None else [])
    if leaf == "qkv_proj" and out is not None and config is not None:
        heads, kv = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", config.num_attention_heads))
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        parts = out.split([heads * dim, kv * dim, kv * dim], dim=-1)
        return _split(module, ("q_proj", "k_proj", "v_proj"), parts, tensors.get("in.0"))
    if leaf == "gate_up_proj" and out is not None:
        return _split(module, ("gate_proj", "up_proj"), out.chunk(2, dim=-1), tensors.get("in.0"))
    if leaf in ("o_proj", "down_proj", "q_norm", "k_norm", "mlp") and out is not None:
        x = tensors.get("in.0")
        return ([(module, "in", "args[0]", x)] if x is not None else []) + [(module, "out", "out", out)]
    if leaf == "self_attn" and out is not None:
        x = tensors.get("in.1", tensors.get("in.hidden_states"))
        return ([(module, "in", "kwargs.hidden_states", x)] if x is not None else []) + [(module, "out", "out[0]", out)]
    return []  # rotary_emb, attn, act_fn, logits_processor: no transformers module of the same meaning


def _split(module: str, names: tuple[str, ...], parts: Any, x: torch.Tensor | None) -> list[tuple[str, str, str, torch.Tensor]]:
    """A fused linear's output as the linears it stands for (each reads the fused one's input)."""
    base = module.rsplit(".", 1)[0]
    made = []
    for name, part in zip(names, parts, strict=True):
        made += [(f"{base}.{name}", "in", "args[0]", x)] if x is not None else []
        made.append((f"{base}.{name}", "out", "out", part))
    return made


def _config_at(path: Any) -> Any:
    if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
        return None
    from fx_precision.checkpoints import read_checkpoint_config

    return read_checkpoint_config(path).config


def _architecture(config: PretrainedConfig) -> str:
    names = (getattr(config, "architectures", None) or []) if config is not None else []
    return str(names[0]) if names else "unknown"


ADAPTER = SglangDumps()
