"""vLLM's module outputs renamed to transformers FQNs: what a teacher-forced training forward's hooks would record.

qkv_proj  (out, bias)        ->  q_proj, k_proj, v_proj outputs (split by head counts; a gated q holds its gate)
in_proj_*, out_proj          ->  the same names (GatedDeltaNet's projections)
gate_up_proj (out, bias)     ->  gate_proj, up_proj outputs
layers.i (mlp_out, residual) ->  layers.i output: bf16(mlp_out + residual), as transformers adds
*_layernorm (x, residual)    ->  input bf16(x + residual); output: the normalised x
self_attn                    ->  out[0];  o_proj, down_proj (out, bias) -> out
model                        ->  out.last_hidden_state
rotary_emb, attn, act_fn, logits_processor: no transformers module of the same meaning (not recorded)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fx_precision.dtypes import dtype_name
from fx_precision.dump import CallInfo, Record

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LAYER = re.compile(r"^model\.layers\.\d+$")
GDN_LINEARS = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # as transformers names them


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _added(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """What transformers' stream holds where vLLM carries (x, residual): their bf16 sum."""
    return x if residual is None else (x.float() + residual.float()).to(x.dtype)


class ModuleRecorder:
    """Forward hooks on vLLM's model recording each prompt's prefill as transformers would name it."""

    def __init__(self, model: nn.Module, config: PretrainedConfig) -> None:
        self.model = model
        heads, kv = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", config.num_attention_heads))
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.qkv = (heads * head_dim, kv * head_dim, kv * head_dim)
        self.chunks: dict[tuple[str, str, str], list[torch.Tensor]] = {}
        self.order: list[str] = []
        self.handles: list[RemovableHandle] = []
        self.pending: dict[int, list[tuple[list[object], dict[str, object]]]] = {}

    def __enter__(self) -> ModuleRecorder:
        for fqn, module in self.model.named_modules():
            if fqn:
                self.handles.append(module.register_forward_pre_hook(self._pre(), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._post(fqn), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre(self) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            clone = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]  # rotary works in place
            self.pending.setdefault(id(module), []).append((clone, dict(kwargs)))

        return hook

    def _post(self, fqn: str) -> Callable[[nn.Module, tuple[object, ...], dict[str, object], object], None]:
        def hook(module: nn.Module, _args: tuple[object, ...], _kwargs: dict[str, object], output: Any) -> None:
            args, kwargs = self.pending[id(module)].pop()
            for name, io, path, tensor in self._rename(fqn, args, kwargs, output):
                key = (name, io, path)
                if key not in self.chunks:
                    self.chunks[key] = []
                    if name not in self.order:
                        self.order.append(name)
                self.chunks[key].append(tensor.detach().cpu().clone())

        return hook

    def _rename(self, fqn: str, args: list[Any], kwargs: dict[str, Any], out: Any) -> list[tuple[str, str, str, torch.Tensor]]:
        leaf = fqn.rsplit(".", 1)[-1]
        arg = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]

        def named(index: int, name: str) -> Any:
            return args[index] if len(args) > index else kwargs.get(name)

        if fqn == "model.embed_tokens":
            return [(fqn, "out", "out", _first(out))]
        if fqn == "model":
            return [(fqn, "out", "out.last_hidden_state", _first(out))]
        if _LAYER.match(fqn):  # forward(positions, hidden_states, residual) -> (mlp_out, residual)
            hidden, residual = named(1, "hidden_states"), named(2, "residual")
            return [(fqn, "in", "args[0]", _added(hidden, residual)), (fqn, "out", "out", _added(out[0], out[1]))]
        if leaf.endswith("layernorm") or fqn == "model.norm":
            return [(fqn, "in", "args[0]", _added(named(0, "x"), named(1, "residual"))), (fqn, "out", "out", _first(out))]
        if leaf == "qkv_proj":
            fused = _first(out)
            q, k, v = self.qkv
            q = fused.shape[-1] - k - v  # a gated attention's q_proj holds the gate too (Qwen3-Next, Qwen3.5: twice q's width)
            parts = fused.split([q, k, v], dim=-1)
            base = fqn.rsplit(".", 1)[0]
            return [r for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True) for r in (
                (f"{base}.{name}", "in", "args[0]", arg[0]), (f"{base}.{name}", "out", "out", part))]  # fmt: skip
        if leaf == "gate_up_proj":
            gate, up = _first(out).chunk(2, dim=-1)
            base = fqn.rsplit(".", 1)[0]
            return [r for name, part in (("gate_proj", gate), ("up_proj", up)) for r in (
                (f"{base}.{name}", "in", "args[0]", arg[0]), (f"{base}.{name}", "out", "out", part))]  # fmt: skip
        if leaf in ("o_proj", "down_proj", "q_norm", "k_norm", "mlp", *GDN_LINEARS):
            return [(fqn, "in", "args[0]", arg[0]), (fqn, "out", "out", _first(out))]
        if leaf == "self_attn":
            return [(fqn, "in", "kwargs.hidden_states", named(1, "hidden_states")), (fqn, "out", "out[0]", _first(out))]
        return []  # rotary_emb, attn, act_fn, logits_processor: no transformers module of the same meaning

    def records(self, call: int) -> tuple[list[Record], list[CallInfo]]:
        """The recorded prefill (its chunks joined along the tokens), as call ``call`` of each module."""
        records, calls = [], []
        for key, pieces in self.chunks.items():
            name, io, path = key
            tensor = torch.cat(pieces, dim=0).unsqueeze(0)  # [tokens, ...] -> [1, tokens, ...] as a batch of one
            records.append(Record(name, call, io, path, dtype_name(tensor.dtype), tuple(tensor.shape), tensor))
        clock = 0
        for name in reversed(self.order):  # children before parents, as transformers' hooks complete
            clock += 1
            calls.append(CallInfo(name, call, -clock, clock))
        self.chunks.clear()
        self.order.clear()
        return records, calls
