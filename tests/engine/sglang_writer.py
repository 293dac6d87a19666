"""Files written exactly as SGLang's dumper (sglang 0.5.23, ``srt/debug_utils/dumper.py``) writes them, from a live model.

The dumper itself cannot be imported here: it imports ``zmq`` and ``sglang.srt`` (managers, runtime context, utils)
at module level, which the ``--no-deps`` wheel does not bring. What it writes is reproduced from its code:

    _NonIntrusiveDumper     forward pre-hooks dump each tensor argument as ``<module>.inputs.<i | kwarg>`` and forward
                            hooks the output as ``<module>.output`` (a tuple of several tensors: ``output.<i>``), all
                            prefixed ``non_intrusive__`` (the root module's names start at ``inputs.`` / ``output``);
                            a tuple or list value holding one tensor is that tensor
    _Dumper._dump_single    dump_index += 1; the file ``step=S___rank=R___dump_index=I___name=N.pt`` under
                            DIR/EXP_NAME/, holding ``{"value": tensor, "meta": {step, rank, dump_index, name,
                            world_rank, world_size}}`` (torch.save)

Hooked on vLLM's model, whose module tree SGLang's shares (qkv_proj, gate_up_proj, a decoder layer's (hidden,
residual), fused norms taking the residual); a decoder layer's arguments are numbered as SGLang's forward(positions,
hidden_states, forward_batch, residual) numbers them (vLLM's has no forward_batch).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

PREFIX = "non_intrusive__"
_LAYER = re.compile(r"^model\.layers\.\d+$")  # forward(positions, hidden_states, forward_batch, residual) in SGLang


class SglangStyleDumper:
    def __init__(self, model: torch.nn.Module, directory: Path, exp_name: str = "dump_test") -> None:
        self.dir = directory / exp_name
        self.step = 0
        self.dump_index = 0
        self.handles: list[Any] = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _dump(self, name: str, value: torch.Tensor) -> None:
        self.dump_index += 1
        tags = {"step": self.step, "rank": 0, "dump_index": self.dump_index, "name": name}
        path = self.dir / ("___".join(f"{k}={v}" for k, v in tags.items()) + ".pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"value": value.detach().clone(), "meta": {**tags, "world_rank": 0, "world_size": 1}}, str(path))

    @staticmethod
    def _convert(value: Any) -> dict[str, torch.Tensor]:
        if isinstance(value, torch.Tensor):
            return {"": value}
        if isinstance(value, (tuple, list)):
            tensors = [t for t in value if isinstance(t, torch.Tensor)]
            return {"": tensors[0]} if len(tensors) == 1 else {str(i): t for i, t in enumerate(tensors)}
        return {}

    def _value(self, module_name: str, value: Any, sub_name: str) -> None:
        for key, item in self._convert(value).items():
            parts = [p for p in (module_name, sub_name, key) if p]
            self._dump(PREFIX + ".".join(parts), item)

    def _pre(self, module_name: str) -> Any:
        layer = _LAYER.match(module_name) is not None

        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            for i, item in enumerate(args):  # SGLang's decoder layer takes forward_batch third: residual is its 4th argument
                self._value(module_name, item, f"inputs.{i + 1 if layer and i >= 2 else i}")
            for key, item in kwargs.items():
                self._value(module_name, item, f"inputs.{key}")

        return hook

    def _post(self, module_name: str) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if output is not None:
                self._value(module_name, output, "output")

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
